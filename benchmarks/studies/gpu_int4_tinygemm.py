"""PyTorch's own int4 kernel (`torch._weight_int4pack_mm`, "tinygemm", gpt-fast's and torchao's W4A16) against the
tree's int4 GEMV and GEMM and cuBLAS bf16, on the 8B shape's four linears (issue 35: int4 batch-1 decode at least
2.5x bf16's). Symmetric groups of 128 (zero point 8, compressed-tensors' pack-quantized), so tinygemm's
(q - 8) * scale + 0 is the same value as `dequantize_int4`; each kernel's error against x @ that weight in float32
is printed beside its time. Each call in a CUDA graph over enough weight copies that none is read from L2.

    python3 benchmarks/studies/gpu_int4_tinygemm.py [--rows 1,2,4,8,16] [--tiles 2,4,8]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from nanoplug.kernels.quant import int4, triton_w4a16, w4a16_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402
from gpu_quant_kernels import LAYERS  # noqa: E402
from studies.gpu_quant_gemv import print_totals  # noqa: E402
from studies.gpu_row_invariance import L2_DEFEAT_BYTES  # noqa: E402


def tinygemm_pack(q: torch.Tensor, scales: torch.Tensor, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values 0..15 [N, K] and scales [N, K/128] as tinygemm's operands: the packed weight (two values a byte, the
    even column in the high nibble, then the kernel's tiling) and [K/128, N, 2] (scale, zero = 0)."""
    packed = ((q[:, ::2].to(torch.int32) << 4) | q[:, 1::2].to(torch.int32)).to(torch.uint8).contiguous()
    sz = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(packed, tiles), sz


def semantics(dev: torch.device) -> None:
    """Which nibble order tinygemm reads (printed: each order's error on a small weight)."""
    q = torch.randint(0, 16, (256, 1024), device=dev, dtype=torch.uint8)
    s = (torch.rand(256, 8, device=dev) * 0.01 + 1e-3).to(torch.bfloat16)
    x = torch.randn(3, 1024, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ int4.dequantize_int4(int4.pack_int4(q), s, None, torch.float32).t()
    for tag, qq in (("even column high", q), ("even column low", q.view(256, 512, 2).flip(-1).reshape(256, 1024))):
        w, sz = tinygemm_pack(qq, s, 8)
        got = torch.ops.aten._weight_int4pack_mm(x, w, 128, sz).float()
        print(f"tinygemm packing, {tag}: relative error {((got - ref).abs().max() / ref.abs().max()).item():.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--tiles", default="2,4,8")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    semantics(dev)
    rows_list = [int(r) for r in args.rows.split(",")]
    tiles_list = [int(t) for t in args.tiles.split(",")]
    totals: dict[tuple[str, int], float] = {}

    def add(tag: str, rows: int, us: float) -> None:
        totals[(tag, rows)] = totals.get((tag, rows), 0.0) + us * 36 / 1e3

    for name, (n, k) in LAYERS.items():
        nbytes = n * k // 2 + n * k // 128 * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        qs = [torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8) for _ in range(copies)]
        scales = [(torch.rand(n, k // 128, device=dev) * 0.01 + 1e-3).to(torch.bfloat16) for _ in range(copies)]
        ours = [(int4.pack_int4(q), s) for q, s in zip(qs, scales)]
        tiny = {t: [tinygemm_pack(q, s, t) for q, s in zip(qs, scales)] for t in tiles_list}
        dense = int4.dequantize_int4(ours[0][0], ours[0][1], None, torch.bfloat16)
        dense_copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
        denses = [dense] + [dense.clone() for _ in range(dense_copies - 1)]
        del qs
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ dense.float().t()
            scale = ref.abs().max().item()
            cells = []

            def run(tag: str, fn, calls: int) -> None:
                err = (fn(0).float() - ref).abs().max().item() / scale
                turn = itertools.cycle(range(calls))
                us = graph_us(lambda: fn(next(turn)), calls=calls)
                add(tag, rows, us)
                cells.append(f"{tag} {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s, err {err:.1e})")

            y = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            run("cublas bf16", lambda i: torch.mm(x, denses[i].t(), out=y), dense_copies)
            run("nanoplug", lambda i: triton_w4a16.w4a16_matmul(x, ours[i][0], ours[i][1], None), copies)
            if rows <= 4:  # the GEMM at the GEMV's rows
                run("nanoplug GEMM", lambda i: w4a16_gemm.matmul(x, ours[i][0], ours[i][1], None, 128, None, None),
                    copies)
            for t in tiles_list:
                try:
                    run(f"tinygemm t{t}", lambda i, t=t: torch.ops.aten._weight_int4pack_mm(x, tiny[t][i][0], 128,
                                                                                             tiny[t][i][1]), copies)
                except RuntimeError as exc:
                    cells.append(f"tinygemm t{t}: {str(exc)[:120]}")
            print(f"{name:8} [{n}x{k}] rows {rows}: " + "; ".join(cells), flush=True)
        del ours, tiny, denses, dense
        torch.cuda.empty_cache()
    print_totals(totals)


if __name__ == "__main__":
    main()
