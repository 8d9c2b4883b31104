"""Where the 8B shape's time goes on one GPU (issue 38 item 4): batch-1 decode at a 512- and a 4,096-token context,
the first token of a 512-token prompt, and prefill of 64 x 1,024 tokens. For each: wall time, the GPU's busy
fraction (kernel time over wall time), the kernels' time by kind, and the achieved rate of the matrix products
(TB/s of weights read at decode, TFLOP/s at prefill). The bench workload's profile is benchmarks/gpu_bench_profile.py
with `--model` the checkpoint this writes.

    python3 benchmarks/studies/gpu_8b_profile.py [--layers 36] [--attention flash]
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from nanoplug import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_ab import batch1_decode  # noqa: E402  (a fresh prompt alone: ms per token, ms to the first)
from gpu_gguf import SHAPE, write_checkpoint  # noqa: E402  (the 8B-shape random bf16 checkpoint)

# attention first: FlashAttention-4's kernels are CUTLASS kernels too
KINDS = (("attention", ("flash", "attn", "decode", "fmha", "paged")),
         ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_", "matmul", "splitk", "small_gemm")),
         ("norm", ("norm",)), ("rope", ("rope",)),
         ("activation", ("silu", "act")), ("sampling", ("gumbel", "argmax", "sample", "exponential", "topk")),
         ("cache", ("cache", "store", "scatter")), ("copy", ("copy", "memcpy", "memset", "fill")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def kernel_table(prof, label: str, wall_s: float, steps: int) -> dict:
    """Print the kernels by kind and the top kernels; return {kind: seconds per step}."""
    by_kind, by_name, counts = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0:
            by_kind[kind_of(e.key)] += e.self_device_time_total / 1e6
            by_name[e.key] += e.self_device_time_total / 1e6
            counts[e.key] += e.count
    busy = sum(by_kind.values())
    print(f"\n== {label}: wall {1e3 * wall_s / steps:.3f} ms a step, GPU busy {1e3 * busy / steps:.3f} ms "
          f"({100 * busy / wall_s:.1f}%), {steps} steps", flush=True)
    for kind, s in by_kind.most_common():
        print(f"   {kind:<11} {1e3 * s / steps:8.3f} ms a step ({100 * s / busy:5.1f}% of kernel time)")
    for name, s in by_name.most_common(14):
        print(f"   {1e6 * s / counts[name]:9.1f} us x{counts[name] / steps:5.1f}/step  {name[:110]}")
    return {k: s / steps for k, s in by_kind.items()}


def weight_bytes(layers: int) -> int:
    h, i, d = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"]
    q, kv = SHAPE["num_attention_heads"] * d, SHAPE["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return 2 * (layers * per_layer + SHAPE["vocab_size"] * h)  # bf16, the LM head read, not the embedding


def decode(llm: LLM, context: int, rng: random.Random, layers: int) -> None:
    """Batch-1 decode after a `context`-token prompt: unprofiled ms/token, then 32 profiled steps."""
    runs = [batch1_decode(llm, rng, context, 128) for _ in range(2)]
    ms, ttft = min(runs)
    floor = weight_bytes(layers) / 4.8e12 * 1e3
    print(f"\nRESULT decode context={context}: {ms:.3f} ms/token (floor at 4.8 TB/s {floor:.2f} ms), "
          f"first token {ttft:.2f} ms (runs {', '.join(f'{r:.3f}/{f:.2f}' for r, f in runs)})", flush=True)
    core = llm.engine
    prompt = [rng.randint(0, 10000) for _ in range(context)]
    core.add_request(core.make_request(prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)))
    for _ in range(8):
        core.step()
    torch.cuda.synchronize()
    steps = 32
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    while core.has_unfinished():
        core.step()
    kinds = kernel_table(prof, f"batch-1 decode, context {context}", wall, steps)
    print(f"   weights at {weight_bytes(layers) / kinds.get('gemm', 1) / 1e12:.2f} TB/s over the GEMM kernels' time, "
          f"{weight_bytes(layers) / (wall / steps) / 1e12:.2f} TB/s over the step's wall time")


def prefill(llm: LLM, rng: random.Random, layers: int) -> None:
    prompts = [[rng.randint(0, 10000) for _ in range(1024)] for _ in range(64)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompts[:8], params, use_tqdm=False)
    torch.cuda.synchronize()
    best = None
    for r in range(2):
        fresh = [[rng.randint(0, 10000)] + p[1:] for p in prompts]  # a new first token: no prefix-cache hits
        t = time.perf_counter()
        llm.generate(fresh, params, use_tqdm=False)
        s = time.perf_counter() - t
        best = s if best is None else min(best, s)
    print(f"\nRESULT prefill 64 x 1024: {64 * 1024 / best:,.0f} tok/s ({best:.3f} s)", flush=True)
    fresh = [[rng.randint(0, 10000)] + p[1:] for p in prompts]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(fresh, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kinds = kernel_table(prof, "prefill 64 x 1024 (the whole generate as one 'step')", wall, 1)
    flops = 2 * (weight_bytes(layers) // 2 - SHAPE["vocab_size"] * SHAPE["hidden_size"]) * 64 * 1024
    print(f"   matrix products at {flops / kinds.get('gemm', 1) / 1e12:.0f} TFLOP/s over the GEMM kernels' time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--attention", default="flash")
    parser.add_argument("--kv-cache", default="triton")
    parser.add_argument("--parts", default="decode,long,prefill")
    args = parser.parse_args()
    t = time.perf_counter()
    path = write_checkpoint(args.layers)
    print(f"checkpoint {path} ready in {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    llm = LLM(str(path), attention=args.attention, kv_cache=args.kv_cache, max_model_len=8192, dtype="bfloat16")
    print(f"engine up in {time.perf_counter() - t:.0f} s", flush=True)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    rng = random.Random(0)
    parts = args.parts.split(",")
    if "decode" in parts:
        decode(llm, 512, rng, args.layers)
    if "long" in parts:
        decode(llm, 4096, rng, args.layers)
    if "prefill" in parts:
        prefill(llm, rng, args.layers)
    llm.close()


if __name__ == "__main__":
    main()
