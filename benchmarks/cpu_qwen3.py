"""Qwen3 on CPU: nanoplug's `generate` against transformers' batched `generate`, same run, same checkpoint.

A small random Qwen3 (hidden 384, 6 layers, GQA 6/2 heads, the real Qwen3 tokenizer and vocabulary)
is written with `save_pretrained`; throughput does not depend on the weights' values. 32 prompts of
64..256 tokens, greedy, eos ignored, float32. transformers gets the batch left-padded, as batched
generation needs. Engines are measured alternately, best of `--repeats`, since the machine may be
shared.

    python benchmarks/cpu_qwen3.py                          # 32 prompts, 64 new tokens
    python benchmarks/cpu_qwen3.py --new-tokens 128 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from _engines import TEXT, Nanoplug, Transformers, nanoplug_options, parse_args

SHAPE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=1024)


def make_prompts(tokenizer, count: int, shortest: int = 64, longest: int = 256) -> list[list[int]]:
    """`count` different prompts of `shortest`..`longest` tokens, cut from one text at different offsets."""
    ids = tokenizer.encode(TEXT * 3)
    span = longest - shortest + 1
    prompts = []
    for i in range(count):
        length = shortest + (i * 37) % span
        start = (i * 11) % (len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts


def measure(engines, prompts, new_tokens: int, repeats: int) -> dict[str, dict]:
    """Best-of-`repeats` wall time of one whole `generate` call per engine, engines interleaved."""
    for engine in engines:  # warm-up: first-call allocations and kernel selection
        engine.generate(prompts[:4], 2)
    results = {e.label: {"seconds": float("inf")} for e in engines}
    for _ in range(repeats):
        for engine in engines:
            start = time.perf_counter()
            tokens = engine.generate(prompts, new_tokens)
            seconds = time.perf_counter() - start
            if seconds < results[engine.label]["seconds"]:
                results[engine.label].update(seconds=seconds, tokens=tokens)
    reference = results[engines[-1].label]["tokens"]
    for r in results.values():
        r["generated_tps"] = sum(map(len, r["tokens"])) / r["seconds"]
        r["total_tps"] = (sum(map(len, prompts)) + sum(map(len, r["tokens"]))) / r["seconds"]
        same = sum(a == b for x, y in zip(r["tokens"], reference) for a, b in zip(x, y))
        r["match"] = same / sum(map(len, reference))
        r["first_token_match"] = sum(x[0] == y[0] for x, y in zip(r["tokens"], reference)) / len(reference)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Qwen3 checkpoint folder (default: write the small random one)")
    parser.add_argument("--prompts", type=int, default=32)
    args = parse_args(parser)
    import transformers
    from transformers import AutoTokenizer

    from nanoplug.bench.checkpoints import write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="nanoplug-bench-") as tmp:
        path = args.model or str(write_random_checkpoint(Path(tmp) / "qwen3-small", "Qwen3ForCausalLM", **SHAPE))
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = make_prompts(tokenizer, args.prompts)
        engines = [Nanoplug(path, **nanoplug_options(args), kv_block_size=32, max_model_len=512,
                            num_kv_blocks=640, device="cpu", dtype="float32"),
                   Transformers(path, label="transformers generate (left-padded batch)")]
        result = measure(engines, prompts, args.new_tokens, args.repeats)
    lengths = sorted(map(len, prompts))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"# Qwen3 {SHAPE['hidden_size']} hidden x {SHAPE['num_hidden_layers']} layers, vocab {len(tokenizer)}; "
          f"{len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens ({sum(lengths)} in all), "
          f"{args.new_tokens} new tokens each, greedy, eos ignored, float32, best of {args.repeats}")
    print("| engine | seconds | generated tok/s | prompt+generated tok/s | speed-up | tokens equal to transformers |")
    print("|---|---:|---:|---:|---:|---:|")
    ref = result[engines[-1].label]["seconds"]
    for engine in engines:
        r = result[engine.label]
        print(f"| {engine.label} | {r['seconds']:.2f} | {r['generated_tps']:.1f} | {r['total_tps']:.1f} | "
              f"{ref / r['seconds']:.2f}x | {100 * r['match']:.1f}% (first token {100 * r['first_token_match']:.0f}%) |")


if __name__ == "__main__":
    main()
