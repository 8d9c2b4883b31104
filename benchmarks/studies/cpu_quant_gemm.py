"""The GGUF-block GEMM of the cpu platform's kernels (quant.cpp) alone: GB/s of weights and GMAC/s by rows.

A weight of random blocks (the default model's gate/up shape, 3072 x 576 Q4_1, and its 49152 x 576 Q8_0
LM head) is repacked into copies that together exceed the last-level cache, and the copies are cycled
through, so each call reads its weight from memory as a decode step does. Each kernel path this CPU runs,
int8 and float32 activations; best of `--repeats`.

    python benchmarks/studies/cpu_quant_gemm.py --threads 1 --cpu-time      # one core, CPU clock (a shared machine)
    python benchmarks/studies/cpu_quant_gemm.py --threads 2
"""
from __future__ import annotations

import argparse
import time

import torch

from nanoplug.kernels.cpu.quant_ops import BLOCKS, FORMATS, quant_kernels

SHAPES = [("Q4_1", 3072, 576), ("Q8_0", 49152, 576)]


def random_blocks(fmt: str, n: int, k: int) -> torch.Tensor:
    block, size = BLOCKS[FORMATS[fmt]]
    raw = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw[..., 0:2] = torch.tensor([0x00, 0x1c], dtype=torch.uint8)  # d = 2^-8 (float16 0x1c00)
    if fmt in ("Q4_1", "Q4_K"):
        raw[..., 2:4] = torch.tensor([0x00, 0x1c], dtype=torch.uint8)
    return raw.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--working-set-mb", type=int, default=100)
    parser.add_argument("--cpu-time", action="store_true", help="the process's CPU clock (with --threads 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    qk = quant_kernels()
    print(f"# {args.threads} thread(s), paths {qk.isas}, working set >= {args.working_set_mb} MB, best of {args.repeats}")
    print("| weight | rows | path | activations | us per call | GB/s of weights | GMAC/s |")
    print("|---|---:|---|---|---:|---:|---:|")
    for fmt, n, k in SHAPES:
        packed = qk.pack(fmt, random_blocks(fmt, n, k), n, k)
        copies = [packed.clone() for _ in range(max(1, args.working_set_mb * 2**20 // packed.numel() + 1))]
        for rows in args.rows:
            x = torch.randn(rows, k)
            for isa in [i for i in qk.isas if i != "portable"]:
                for int8 in (True, False):
                    fns = [qk.matmul(fmt, c, n, k, isa) for c in copies]
                    best = float("inf")
                    for _ in range(args.repeats):
                        start = clock()
                        for fn in fns:
                            fn(x, None, int8)
                        best = min(best, (clock() - start) / len(fns))
                    print(f"| {fmt} {n}x{k} | {rows} | {isa} | {'int8' if int8 else 'float32'} | {best * 1e6:.1f} | "
                          f"{packed.numel() / best / 1e9:.1f} | {rows * n * k / best / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
