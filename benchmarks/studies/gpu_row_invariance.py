"""The small-GEMM kernel at a few rows (issue 37: a verification's rows must compute what a one-row decode step
computes): whether each row of an M-row product is bit-equal to the same row alone, and its time against cuBLAS
at each row count, on the decoder weight shapes of SmolLM2-135M, Qwen3-0.6B and Qwen3-8B in bf16. Each time is a
CUDA graph of products over enough weight copies that none is read from L2.

    python3 benchmarks/studies/gpu_row_invariance.py [--rows 1,2,3,4,5,8] [--shapes smollm2,0.6b,8b]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from nanoplug.kernels.cuda import small_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402  (calls captured in one CUDA graph, the median replay)

triton = small_gemm.triton
SHAPES = {"smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                      "lm_head": (49152, 576)},
          "0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
          "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)}}
L2_DEFEAT_BYTES = 512 << 20


def kernel(x: torch.Tensor, w: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """The kernel whatever `takes` says (the row count is what is studied)."""
    (rows, k), n = x.shape, w.shape[0]
    y = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k = small_gemm._blocks(k)
    small_gemm._small_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, w, y, rows, n, k, x.stride(0), w.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(rows),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=False, num_warps=4, num_stages=2)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,8")
    parser.add_argument("--shapes", default="smollm2,0.6b,8b")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name())
    for shape in args.shapes.split(","):
        print(f"\n{shape}: us per product, kernel / cuBLAS (ratio), and whether every row equals itself alone")
        for name, (n, k) in SHAPES[shape].items():
            copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            cells = []
            for rows in rows_list:
                x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                alone = torch.cat([kernel(x[i:i + 1], ws[0]) for i in range(rows)])
                same = torch.equal(kernel(x, ws[0]), alone)
                alone32 = torch.cat([kernel(x[i:i + 1], ws[0], torch.float32) for i in range(rows)])
                same = same and torch.equal(kernel(x, ws[0], torch.float32), alone32)
                turn = itertools.cycle(range(copies))
                t_kernel = graph_us(lambda: kernel(x, ws[next(turn)]), calls=copies)
                y = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
                t_cublas = graph_us(lambda: torch.mm(x, ws[next(turn)].t(), out=y), calls=copies)
                ratio = f"{t_kernel:.1f}/{t_cublas:.1f} ({t_kernel / t_cublas:.2f})"
                cells.append(f"{rows}: {ratio}{'' if same else ' DIFFER'}")
            print(f"  {name:8} N={n:<6} K={k:<5} " + "  ".join(cells), flush=True)
            del ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
