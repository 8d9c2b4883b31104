"""SmolLM2-135M decode throughput on CPU: nanoplug against transformers' `generate`, same run.

Both engines get the same token-id prompts (lengths 32..64), greedy, eos ignored, float32 (or --dtype).
Decode tokens/s = batch * (new_tokens - 1) / (time(new_tokens) - time(1)): the prefill and the
first token cost the same in both runs, so the difference is pure decode steps. The machine may
be shared, so the two engines are measured alternately, best of `--repeats`.

    python benchmarks/cpu_smollm2.py                  # batch 1 and 32, 64 new tokens
    python benchmarks/cpu_smollm2.py --batch 32 --new-tokens 128 --attention sdpa
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from _engines import TEXT, Nanoplug, Transformers, nanoplug_options, parse_args


def make_prompts(tokenizer, batch: int) -> list[list[int]]:
    """`batch` different prompts of 32..64 tokens, cut from one text at different offsets."""
    ids = tokenizer.encode(TEXT)
    prompts = []
    for i in range(batch):
        length = 32 + (i * 13) % 33
        start = (i * 7) % (len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts


def timed(engine, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = engine.generate(prompts, new_tokens)
    return time.perf_counter() - start, tokens


def measure(engines, prompts, new_tokens, repeats) -> dict[str, dict[str, float]]:
    """Best-of-`repeats` times for 1 and `new_tokens` new tokens, engines interleaved."""
    best = {e.label: {"first": float("inf"), "full": float("inf")} for e in engines}
    outputs = {}
    for engine in engines:  # warm-up: first-call allocations and oneDNN kernels selection
        timed(engine, prompts, 2)
    for _ in range(repeats):
        for engine in engines:
            t1, _ = timed(engine, prompts, 1)
            tn, outputs[engine.label] = timed(engine, prompts, new_tokens)
            best[engine.label]["first"] = min(best[engine.label]["first"], t1)
            best[engine.label]["full"] = min(best[engine.label]["full"], tn)
    batch = len(prompts)
    for label, b in best.items():
        b["decode_tps"] = batch * (new_tokens - 1) / max(b["full"] - b["first"], 1e-9)
        b["total_tps"] = batch * new_tokens / b["full"]
    ref = outputs[engines[-1].label]
    for label, toks in outputs.items():
        same = sum(a == b for x, y in zip(toks, ref) for a, b in zip(x, y))
        best[label]["match"] = same / sum(map(len, ref))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parse_args(parser)
    if args.model is None:
        from nanoplug.checkpoint.default_model import default_model_path

        args.model = str(default_model_path(float32=True))
    from transformers import AutoTokenizer

    import transformers

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    options = nanoplug_options(args)
    options["cpu"]["kv_cache_gb"] = 1.0
    engines = [Nanoplug(args.model, **options, kv_block_size=16, max_model_len=512, enable_prefix_caching=False,
                        dtype=args.dtype),
               Transformers(args.model, args.dtype)]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}")
    print(f"# greedy, eos ignored, {args.dtype}, prompts of 32-64 tokens, {args.new_tokens} new tokens, "
          f"best of {args.repeats}, engines measured alternately in one process")
    print("| batch | engine | decode tok/s | end-to-end tok/s | speed-up (decode) | greedy tokens equal to transformers |")
    print("|---:|---|---:|---:|---:|---:|")
    for batch in args.batch:
        prompts = make_prompts(tokenizer, batch)
        result = measure(engines, prompts, args.new_tokens, args.repeats)
        ref = result[engines[-1].label]["decode_tps"]
        for engine in engines:
            r = result[engine.label]
            print(f"| {batch} | {engine.label} | {r['decode_tps']:.1f} | {r['total_tps']:.1f} | "
                  f"{r['decode_tps'] / ref:.2f}x | {100 * r['match']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
