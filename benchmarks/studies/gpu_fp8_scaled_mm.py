"""Block-scaled fp8 GEMMs (issue 35: the bench workload at >= 1.3x bf16's with fp8 [128, 128] blocks): the Triton
GEMM of kernels/quant/triton_fp8.py against cuBLAS's own block-scaled fp8 GEMM (torch.nn.functional.scaled_mm,
activations BlockWise1x128 x weights BlockWise128x128, SM90) and cuBLAS bf16, on the 8B shape's linear layers at
several batch sizes; each with its error against dequantize-then-matmul. Activation quantizing included in both.

    python3 benchmarks/studies/gpu_fp8_scaled_mm.py [--rows 5,8,64,256,1024,2048]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from nanoplug.kernels.quant import cublas_fp8, fp8, triton_fp8

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402
from gpu_quant_kernels import LAYERS  # noqa: E402  (the 8B shape's four linears)

BLOCK = cublas_fp8.BLOCK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="5,8,64,256,1024,2048")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
    print("cuBLAS block-scaled fp8:", cublas_fp8.unavailable(dev, 4096, 4096, BLOCK) or "available")
    totals: dict[tuple[str, int], float] = {}
    for name, (n, k) in LAYERS.items():
        w = (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(n // 128, k // 128, device=dev) * 1e-3 + 1e-4
        ws_t = cublas_fp8.weight_scales(scale)
        dense = fp8.dequantize_blocks(w, scale, BLOCK, torch.bfloat16)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ fp8.dequantize_blocks(w, scale, BLOCK, torch.float32).t()
            runs = {"cublas bf16": lambda: x @ dense.t(),
                    "triton fp8": lambda: triton_fp8.fp8_block_matmul(x, w, scale, BLOCK),
                    "cublas fp8": lambda: cublas_fp8.matmul(x, w, ws_t)}
            cells = []
            for tag, fn in runs.items():
                try:
                    err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                    us = graph_us(fn, calls=10)
                except Exception as exc:  # noqa: BLE001 (say why, go on)
                    cells.append(f"{tag}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                totals[(tag, rows)] = totals.get((tag, rows), 0.0) + us * 36 / 1e3
                cells.append(f"{tag} {us:.1f} us (err {err:.1e})")
            print(f"{name:8} [{n}x{k}] rows {rows}: " + "  ".join(cells), flush=True)
    print("\n| kernel | rows | ms a step in the 36 layers' linears |\n| --- | ---: | ---: |")
    for (tag, rows), ms in sorted(totals.items(), key=lambda t: (t[0][1], t[0][0])):
        print(f"| {tag} | {rows} | {ms:.3f} |")


if __name__ == "__main__":
    main()
