"""The CPU-dependent choices the cpu platform measures at first start (nanoplug/kernels/cpu/choices.py), over more
row counts: nanoplug's packed float32 GEMM against F.linear (MKL), and the GGUF GEMM's activation modes (float32,
int8x2, llama.cpp's int8), on SmolLM2-135M's MLP shapes. Force the AVX2 build and path on an AVX-512 machine with
`NANOPLUG_CPU_MARCH=x86-64-v3 NANOPLUG_CPU_ISA=avx2` (the portable ones: `x86-64`, `portable`).

    python benchmarks/cpu_choices.py --threads 2
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_gguf import commit, cpu_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]

    from nanoplug.kernels.cpu import choices, kernels
    from nanoplug.kernels.cpu.quant_ops import quant_kernels

    ops, quant = kernels(), quant_kernels()
    print(f"# {cpu_name()}, torch {torch.__version__} ({args.threads} threads), nanoplug {commit()}; float kernels "
          f"-march={os.environ.get('NANOPLUG_CPU_MARCH', 'native')}, GGUF path {quant.best}")
    gen = torch.Generator().manual_seed(0)
    print("\n| rows | packed GEMM ms | F.linear ms | packed / F.linear |\n|---:|---:|---:|---:|")
    for r in rows:
        packed = plain = 0.0
        for n, k in choices.SHAPES:
            w, x = torch.randn(n, k, generator=gen), torch.randn(r, k, generator=gen)
            p = ops.pack_weight(w)
            packed += choices._best_s(lambda: ops.linear(x, p, w, None))
            plain += choices._best_s(lambda: torch.nn.functional.linear(x, w))
        print(f"| {r} | {packed * 1e3:.3f} | {plain * 1e3:.3f} | {packed / plain:.2f} |")
    weights = [(quant.pack("Q4_1", choices._random_q4_1(n, k, gen), n, k), n, k) for n, k in choices.SHAPES]
    print("\n| rows | float ms | int8x2 ms | int8 ms | int8x2 / float |\n|---:|---:|---:|---:|---:|")
    for r in rows:
        xs = [torch.randn(r, k, generator=gen) for _, _, k in weights]
        ms = {act: sum(choices._best_s(lambda: quant.linear(x, "Q4_1", p, n, k, act=act))
                       for x, (p, n, k) in zip(xs, weights)) * 1e3 for act in ("float", "int8x2", "int8")}
        print(f"| {r} | {ms['float']:.3f} | {ms['int8x2']:.3f} | {ms['int8']:.3f} | {ms['int8x2'] / ms['float']:.2f} |")
    answer = choices.measure_gguf_activations(quant)
    print(f"\nthe platform's choice here: {choices.describe('gguf_activations', answer, 'measured')}")
    print(f"and: {choices.describe('weight_packing', choices.measure_packing(ops), 'measured')}")


if __name__ == "__main__":
    main()
