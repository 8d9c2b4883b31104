"""The pre-quantized weight kernels alone on the 8B shape's linear layers (issue 35): bf16 F.linear against the
Triton W4A16 and block-scaled fp8 kernels, each call captured in a CUDA graph (no launch overhead), for a decode
row and a prefill batch; the per-token sum over the 36 layers' four linears is what batch-1 decode spends in them.

    python3 benchmarks/gpu_quant_kernels.py              # table to stdout and $OUT/gpu_quant_kernels.json
    python3 benchmarks/gpu_quant_kernels.py --rows 1,4,256 --fp8-split 1,2,4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _cuda_timing import graph_us  # noqa: E402

GEMM_CONFIGS = [(64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (128, 256, 8, 3)]
# the int4 GEMM's tiles (w4a16_gemm.config's: BLOCK_M, BLOCK_N, BLOCK_K at most, warps, stages)
INT4_CONFIGS = [(16, 64, 128, 4, 4), (32, 128, 128, 4, 3), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3),
                (64, 256, 64, 8, 3), (256, 128, 64, 8, 3)]
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main() -> int:
    import torch
    import torch.nn.functional as F

    from nanoplug.kernels.quant import int4, triton_fp8, triton_w4a16

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,256,2048")
    parser.add_argument("--split", default="", help="split-K values to try for the GEMVs beside their own choice")
    parser.add_argument("--block-n", default="", help="GEMV rows per program to try beside the defaults")
    parser.add_argument("--sweep-gemm", action="store_true", help="each GEMM in each of GEMM_CONFIGS too")
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    splits = [None] + [int(s) for s in args.split.split(",") if s]
    block_ns = [None] + [int(b) for b in args.block_n.split(",") if b]
    results = []
    totals: dict[tuple[str, int], float] = {}
    for name, (n, k) in LAYERS.items():
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)
        packed = int4.pack_int4(q)
        scales = (torch.rand(n, k // 128, device=dev) * 0.01).to(torch.bfloat16)
        w8 = (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn)
        s8 = torch.rand(n // 128, k // 128, device=dev) * 1e-3
        for m in rows:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            runs = {"bf16": lambda: F.linear(x, w)}
            if m <= triton_fp8.GEMV_ROWS:
                for s in splits:
                    for b in block_ns:
                        tag = (f" s{s}" if s else "") + (f" n{b}" if b else "")
                        runs["int4" + tag] = lambda s=s, b=b: triton_w4a16.w4a16_matmul(x, packed, scales, None, s, b)
                        runs["fp8" + tag] = lambda s=s, b=b: triton_fp8.fp8_block_matmul(x, w8, s8, (128, 128), s, b)
            else:  # the Triton GEMMs in each config, and dequantize + cuBLAS for int4
                for c in [None] + (GEMM_CONFIGS if args.sweep_gemm else []):
                    tag = "" if c is None else " " + "x".join(map(str, c))
                    runs["fp8" + tag] = lambda c=c: triton_fp8.fp8_block_matmul(x, w8, s8, (128, 128), gemm=c)
                for c in [None] + (INT4_CONFIGS if args.sweep_gemm else []):
                    tag = "" if c is None else " " + "x".join(map(str, c))
                    runs["int4" + tag] = lambda c=c: forced(1 << 30, c)
                runs["int4 dq+cublas"] = lambda: forced(1, None)

                def forced(rows_at: int, c):
                    saved, triton_w4a16.DEQUANT_ROWS = triton_w4a16.DEQUANT_ROWS, rows_at
                    try:
                        return triton_w4a16.w4a16_matmul(x, packed, scales, None, gemm=c)
                    finally:
                        triton_w4a16.DEQUANT_ROWS = saved
            for kind, fn in runs.items():
                try:
                    us = graph_us(fn)
                except Exception as exc:  # noqa: BLE001  (a config that does not compile: say so, go on)
                    print(f"{name:8s} rows {m:4d} {kind:12s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                nbytes = (2 if kind == "bf16" else 0.5 + 2 / 128 if kind.startswith("int4") else 1) * n * k
                results.append(dict(layer=name, n=n, k=k, rows=m, kind=kind, us=us, gb_s=nbytes / us / 1e3))
                totals[(kind, m)] = totals.get((kind, m), 0.0) + us * 36 / 1000
                print(f"{name:8s} [{n}x{k}] rows {m:4d} {kind:12s} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s", flush=True)
    print("\n| kernel | rows | ms per token in the 36 layers' linears |\n| --- | ---: | ---: |")
    for (kind, m), ms in totals.items():
        print(f"| {kind} | {m} | {ms:.3f} |")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_quant_kernels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
