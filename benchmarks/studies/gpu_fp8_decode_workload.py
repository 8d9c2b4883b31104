"""Decode attention over an fp8 cache on the bench run's own batches (issue 15): the shipped path against a
bf16 cache, against the same cache without its rotation, and at other pipeline depths.

For every 32nd decode step of the run (its running sequences and their context lengths, from the workload
generator; the split count `flash` would pick), each variant runs 28 times (one per layer) inside a CUDA
graph: us per call, and the run's estimated total (the sum over the sampled steps times 32, times 28 layers).
Variants: `bf16` (the 16-bit cache, as `flash` decodes it on Hopper); `fp8` (shipped: q and the output turned
by the cache's Hadamard rotation inside the kernel); `fp8 gemms` (turned by two GEMMs around the kernel, as
any other rotation is); `fp8 unrotated` (a cache kept without rotation: the kernel alone); then the shipped
path under other launch settings (`--configs`: DecodeConfig fields, e.g.
`num_stages_8bit=3;num_warps=8,num_stages_8bit=1`).

usage: python benchmarks/studies/gpu_fp8_decode_workload.py [--every 32] [--configs num_stages_8bit=3]
"""
from __future__ import annotations

import argparse

import torch

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _cuda_timing import graph_us
from gpu_decode_workload import D, KVH, LAYERS, dev, dt, sampled_steps
from nanoplug.kernels.attention import triton_decode as td
from nanoplug.plugins.kv_cache.fp8 import hadamard

PAGE, MAX_LEN = 256, 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=32)
    parser.add_argument("--configs", default="num_stages_8bit=3",
                        help="other launch settings to time the fp8 path at: DecodeConfig fields, ';' between settings")
    args = parser.parse_args()
    width = -(-MAX_LEN // PAGE)
    blocks = 256 * width + 1
    torch.manual_seed(0)
    k16 = torch.randn(blocks, PAGE, KVH, D, device=dev, dtype=dt)
    v16 = torch.randn_like(k16)
    k8, v8 = k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    rot = hadamard(D).to(dev, dt)
    perm = torch.randperm(blocks - 1, device=dev).to(torch.int32)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = td.DecodeConfig()
    others = {f"fp8 {c}": td.DecodeConfig(**{k: int(v) for k, v in (f.split("=") for f in c.split(","))})
              for c in args.configs.split(";") if c}
    names = ["bf16", "fp8", "fp8 gemms", "fp8 unrotated", *others]
    totals = dict.fromkeys(names, 0.0)
    print("columns:", ", ".join(names))
    print(f"{'step':>5} {'batch':>5} {'splits':>6} " + " ".join(f"{i:>8}" for i in range(len(names))) + "   (us per call)")
    for step, lens, table, used, q in sampled_steps(args.every, width, perm):
        b = len(lens)
        splits, scale = td.num_splits(b, KVH, MAX_LEN, sms, cfg), D ** -0.5
        calls = {"bf16": lambda: td.paged_decode(q, k16, v16, table, used, scale, splits),
                 "fp8": lambda: td.paged_decode(q, k8, v8, table, used, scale, splits, one, one, rotation=rot,
                                                hadamard=True),
                 "fp8 gemms": lambda: td.paged_decode(q, k8, v8, table, used, scale, splits, one, one, rotation=rot),
                 "fp8 unrotated": lambda: td.paged_decode(q, k8, v8, table, used, scale, splits, one, one)}
        for name, other in others.items():
            calls[name] = lambda other=other: td.paged_decode(q, k8, v8, table, used, scale, splits, one, one, other,
                                                              rotation=rot, hadamard=True)
        ref = calls["fp8"]().float()
        for name in [n for n in names if n.startswith("fp8") and n != "fp8 unrotated"]:
            err = (calls[name]().float() - ref).abs().max().item()
            assert err < 2e-2, (name, err)
        times = {n: graph_us(f, calls=LAYERS) for n, f in calls.items()}
        for n in names:
            totals[n] += times[n] * args.every * LAYERS / 1e6
        print(f"{step:5d} {b:5d} {splits:6d} " + " ".join(f"{times[n]:8.1f}" for n in names), flush=True)
    print("the run's decode attention, estimated (s): " + ", ".join(f"{n} {t:.3f}" for n, t in totals.items()))


if __name__ == "__main__":
    main()
