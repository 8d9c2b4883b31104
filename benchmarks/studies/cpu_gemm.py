"""The GEMMs of one SmolLM2-135M decode step on CPU: F.linear, MKL's packed sgemm and nanoplug's GEMM
(nanoplug/kernels/cpu), at 1-64 rows.

The step's 121 GEMMs (30 layers of qkv, o, gate+up, down, then the LM head) run back to back on
separate random weights, so the weights stream from memory as in a real decode step (540 MB). Best of 3.

    python benchmarks/studies/cpu_gemm.py [--rows 1 4 16 32 64]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nanoplug.kernels import cpu as cpu_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate+up, down
LAYERS, VOCAB = 30, 49152


def best_of(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 48, 64])
    args = parser.parse_args()
    kernels = cpu_kernels.kernels()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / 30 for _ in range(LAYERS) for n, k in SHAPES]
    weights.append(torch.randn(VOCAB, 576, generator=gen) / 30)
    ours = [kernels.pack_weight(w) for w in weights]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 32) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"# {torch.get_num_threads()} threads, {len(weights)} GEMMs, "
          f"{sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB of weights")
    print("| rows | F.linear ms | MKL packed ms | nanoplug ms | nanoplug GFLOPS |")
    print("|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        plain = best_of(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
        packed = best_of(lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, rows) for w, p in zip(weights, mkl)])
        nano = best_of(lambda: [kernels.linear(xs[w.shape[1]], p, w, None) for w, p in zip(weights, ours)])
        print(f"| {rows} | {plain * 1e3:.1f} | {packed * 1e3:.1f} | {nano * 1e3:.1f} | {rows * flops_per_row / nano / 1e9:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
