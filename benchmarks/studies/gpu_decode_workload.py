"""Decode attention over the bench run's own batches: FlashAttention-4's paged decode against our Triton
flash-decoding kernel (triton_decode.py) at several split counts, on a bf16 cache.

The bench workload's decode steps are not the uniform batch of a micro-benchmark: contexts run from 100 to
2,011 tokens and the batch shrinks from 256 to 1. One program per (sequence, KV head) then waits on the
longest sequence; splitting each context into equal parts evens that out. For every 32nd decode step of the
run (its running sequences and their context lengths, from the workload generator), each kernel runs 28
times (one per layer) inside a CUDA graph; the figures are per call, and the run's total is the sum over the
sampled steps times 32, times 28 layers. Every kernel has run (and compiled) in the check against FA4's output
before it is captured.

usage: python benchmarks/studies/gpu_decode_workload.py [--page 256] [--every 32] [--splits 1,2,4,8]
"""
from __future__ import annotations

import argparse

import torch
from flash_attn.cute.interface import flash_attn_varlen_func

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _cuda_timing import graph_us
from nanoplug.bench.throughput import workload
from nanoplug.kernels.attention import triton_decode as td

dev, dt = torch.device("cuda"), torch.bfloat16
H, KVH, D, LAYERS = 16, 8, 128, 28
TOKEN_BYTES = KVH * D * 2 * 2  # K and V of one token in one layer


def run_lengths() -> tuple[list[int], list[int]]:
    """The bench workload's prompt and output lengths."""
    prompts, params = workload()
    return [len(p) for p in prompts], [p.max_tokens for p in params]


def sampled_steps(every: int, width: int, perm: torch.Tensor):
    """(step, context lengths, block tables, the lengths on the GPU, a query) for every `every`-th decode step of
    the bench run: its running sequences, each on its own pages (rows of `width` from `perm`)."""
    prompts, outs = run_lengths()
    for step in range(1, max(outs), every):
        lens = [p + step for p, o in zip(prompts, outs) if o - 1 >= step]
        if not lens:
            return
        b = len(lens)
        table = perm[: b * width].view(b, width).contiguous()
        used = torch.tensor(lens, dtype=torch.int32, device=dev)
        yield step, lens, table, used, torch.randn(b, H, D, device=dev, dtype=dt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--every", type=int, default=32)
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--max-model-len", type=int, default=4096, help="the graphs' max_seqlen_k")
    args = parser.parse_args()
    splits = [int(s) for s in args.splits.split(",")]
    page = args.page
    width = -(-args.max_model_len // page)
    blocks = 256 * width + 1
    torch.manual_seed(0)
    k = torch.randn(blocks, page, KVH, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    perm = torch.randperm(blocks - 1, device=dev).to(torch.int32)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    names = ["fa4"] + [f"triton s={s}" for s in splits] + ["triton auto"]
    totals = dict.fromkeys(names, 0.0)
    print(f"{'step':>5} {'batch':>5} {'mean ctx':>8} {'max ctx':>7} " + " ".join(f"{n:>12}" for n in names)
          + "   (us per call; TB/s of the best)")
    for step, lens, table, used, q in sampled_steps(args.every, width, perm):
        b, scale = len(lens), D ** -0.5
        calls = {"fa4": lambda: flash_attn_varlen_func(q.unsqueeze(1), k, v, seqused_k=used, page_table=table,
                                                        softmax_scale=scale, causal=True)}
        for s in splits:
            calls[f"triton s={s}"] = lambda s=s: td.paged_decode(q, k, v, table, used, scale, s)
        auto = td.num_splits(b, KVH, args.max_model_len, sms, td.DecodeConfig())
        calls["triton auto"] = lambda: td.paged_decode(q, k, v, table, used, scale, auto)
        ref = calls["fa4"]()
        ref = (ref[0] if isinstance(ref, tuple) else ref).squeeze(1).float()
        for name in names[1:]:
            err = (calls[name]().float() - ref).abs().max().item()
            assert err < 2e-2, (name, err)
        times = {n: graph_us(f, calls=LAYERS) for n, f in calls.items()}
        for n in names:
            totals[n] += times[n] * args.every * LAYERS / 1e6
        best = min(times.values())
        print(f"{step:5d} {b:5d} {sum(lens) / b:8.0f} {max(lens):7d} " + " ".join(f"{times[n]:12.1f}" for n in names)
              + f"   {sum(lens) * TOKEN_BYTES / best / 1e6:.2f}")
    print("the run's decode attention, estimated (s): " + ", ".join(f"{n} {t:.3f}" for n, t in totals.items()))


if __name__ == "__main__":
    main()
