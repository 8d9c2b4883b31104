"""What serving LoRA adapters per request costs against merging one, on one GPU (Qwen3-0.6B shape, bf16).

The `nanoplug bench` workload (256 requests, nano-vllm's draw) on these engines, one after another:
  base            no adapter
  merged          one LoRA merged into the weights at load
  per-request     the same LoRA served per request (merge=False), every request asking for it
  per-request xK  K LoRAs served per request, the requests spread round-robin over them (K = 4, 8, 16, 32
                  by default: the issue's bar is 0.7x merged at K = 4, and about the same cost at K = 32)
Every LoRA has rank 16 on all seven projections (q, k, v, o, gate, up, down), random, written as a
PEFT folder. The figure is output tokens over the wall seconds of one `generate`, after a warm-up.
Before the timing, greedy tokens of the per-request engine (one adapter) are compared with those of
the merged engine (bf16: a near-tie may flip a token, so the agreement is printed, not asserted).
Each engine's line says whether it decoded under CUDA graphs and how many decode steps ran eager.

    python benchmarks/gpu_lora.py                     # every engine, the full workload
    python benchmarks/gpu_lora.py --num-seqs 64 --max-output-len 256 --adapters 4,32 --attention flash --kv-cache triton
Prints a markdown table for benchmarks/RESULTS.md at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanoplug import LLM, SamplingParams
from nanoplug.bench.throughput import default_checkpoint_dir, workload, write_checkpoint
from nanoplug.bench.checkpoints import QWEN3_0_6B_SHAPE

PROJECTIONS = {  # name -> (block, in features, out features) of Qwen3-0.6B
    "q_proj": ("self_attn", 1024, 16 * 128), "k_proj": ("self_attn", 1024, 8 * 128),
    "v_proj": ("self_attn", 1024, 8 * 128), "o_proj": ("self_attn", 16 * 128, 1024),
    "gate_proj": ("mlp", 1024, 3072), "up_proj": ("mlp", 1024, 3072), "down_proj": ("mlp", 3072, 1024),
}


def write_lora(folder: Path, base: Path, seed: int, rank: int = 16) -> str:
    """A random PEFT LoRA folder (rank `rank`, alpha 2*rank) on all seven projections of every layer."""
    if (folder / "adapter_model.safetensors").is_file():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(QWEN3_0_6B_SHAPE["num_hidden_layers"]):
        for name, (block, fan_in, fan_out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).bfloat16()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                  target_modules=list(PROJECTIONS), base_model_name_or_path=str(base), bias="none")
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return str(folder)


def timed(llm: LLM, prompts, params) -> tuple[float, int]:
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # untimed warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    return seconds, sum(len(o.token_ids) for o in outputs)


def greedy_tokens(llm: LLM, adapter: str | None) -> list[list[int]]:
    prompts, _ = workload(8, 256, 100)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, adapter=adapter)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def free(llm: LLM) -> None:
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--adapters", default="4,8,16,32", help="K of each per-request xK engine, comma-separated")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--kv-cache", default="auto")
    args = parser.parse_args()

    counts = [int(k) for k in args.adapters.split(",")]
    base = write_checkpoint()
    loras = [write_lora(default_checkpoint_dir().parent / f"lora-r{args.rank}-{k}", base, seed=k, rank=args.rank)
             for k in range(max(counts))]
    options = dict(attention=args.attention, kv_cache=args.kv_cache, max_model_len=4096)
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    names = [f"lora{k}" for k in range(max(counts))]
    per_request = [{"path": p, "name": n, "merge": False} for p, n in zip(loras, names)]
    engines = [
        ("base", "none", [], [None]),
        ("merged", "1 merged", [loras[0]], [None]),
        ("per-request", "1 per request", per_request[:1], [names[0]]),
    ] + [(f"per-request x{k}", f"{k} per request, mixed", per_request[:k], names[:k]) for k in counts]
    rows, merged_greedy = [], None
    for label, what, adapters, choices in engines:
        t0 = time.perf_counter()
        llm = LLM(str(base), adapters=adapters, **options)
        startup = time.perf_counter() - t0
        if label == "merged":
            merged_greedy = greedy_tokens(llm, None)
        elif label == "per-request":
            got = greedy_tokens(llm, names[0])
            same = sum(a == b for g, m in zip(got, merged_greedy) for a, b in zip(g, m))
            print(f"greedy agreement, per-request vs merged: {same}/{sum(map(len, got))} tokens, "
                  f"{sum(g == m for g, m in zip(got, merged_greedy))}/{len(got)} sequences identical", flush=True)
        request_params = [p.model_copy(update={"adapter": choices[i % len(choices)]}) for i, p in enumerate(params)]
        seconds, tokens = timed(llm, prompts, request_params)
        rows.append((label, what, tokens / seconds, seconds, startup))
        stats = llm.engine.worker.report().stats
        print(json.dumps(dict(engine=label, adapters=what, output_tok_per_s=round(tokens / seconds, 1),
                              seconds=round(seconds, 2), startup_s=round(startup, 1),
                              graphs=llm.engine.worker.graphs is not None, graph_replays=stats.graph_replays,
                              eager_decode_steps=stats.eager_decode_steps + stats.eager_decode_steps_by_design,
                              plugins=llm.describe_plugins())), flush=True)
        free(llm)

    merged_rate = rows[1][2]
    print(f"\n{torch.cuda.get_device_name()}, Qwen3-0.6B shape bf16, LoRA rank {args.rank} on q,k,v,o,gate,up,down, "
          f"{args.num_seqs} requests (nanoplug bench workload)\n")
    print("| engine | adapters | output tok/s | vs merged | generate s | start-up s |")
    print("|---|---|---:|---:|---:|---:|")
    for label, what, rate, seconds, startup in rows:
        print(f"| {label} | {what} | {rate:,.0f} | {rate / merged_rate:.2f}x | {seconds:.2f} | {startup:.1f} |")
    mixed = [(label, rate) for label, _, rate, _, _ in rows[3:]]
    if len(mixed) > 1:
        (first, first_rate), (last, last_rate) = mixed[0], mixed[-1]
        print(f"\n{last} against {first}: {last_rate / first_rate:.2f}x (flat: the cost follows the tokens, "
              "not the adapters loaded)")


if __name__ == "__main__":
    main()
