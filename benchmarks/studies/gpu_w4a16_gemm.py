"""int4 W4A16 GEMM layouts for 5-255 rows on the 8B shape's four linears (issue 35's int4 bench: the Triton GEMM of
7f7f148 ran at 0.26x cuBLAS at 256 rows), each against cuBLAS on bf16 weights of the same shape, dequantize-then-
cuBLAS and the tree's own path, over enough weight copies that none is read from L2 (calls in one CUDA graph):

- shifts, pairs: the tree's GEMM (kernels/quant/w4a16_gemm.py: the weight as the dot's A operand, out^T = W @ x^T,
  each word loaded once and its values joined in the word's order) in each of TILES, its values opened by shifts in
  float32 or two at a time by PTX;
- a: the weight as A, words loaded once per value (eight loads of each word) and shifted by the value's place;
- c: x as A, the weight as B, words loaded once per value (GemLite's layout);
- d: x as A, the weight as B, words loaded once and joined.

Each result is checked against dequantize-then-matmul (bf16 weights, float32 sums); K splits add the programs'
float32 tiles in shared partials (split_k.finish_tile).

    python3 benchmarks/studies/gpu_w4a16_gemm.py [--rows 1,16,64,256] [--variants pairs,shifts,a,c,d] [--splits 1,4]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoplug.kernels.quant import int4, split_k, triton_w4a16, w4a16_gemm

triton, tl = triton_w4a16.triton, triton_w4a16.tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402  (calls captured in one CUDA graph, the median replay)
from gpu_quant_kernels import LAYERS  # noqa: E402  (the 8B shape's four linears)
from studies.gpu_row_invariance import L2_DEFEAT_BYTES  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried: the tree's kernel in TILES, the other layouts in theirs
TILES = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 128, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3),
         (64, 128, 64, 4, 4), (128, 64, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)]
CONFIGS = {"pairs": TILES, "shifts": TILES,
           "a": [(16, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4)],
           "c": [(16, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4)],
           "d": [(16, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3),
                 (128, 256, 64, 8, 3)]}


@triton.jit
def _scale_zero(s_ptr, z_ptr, rn, n_ok, g, ssn, szn, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr):
    # group g's scales and 2^23 + zero (the float32 path's form) for rows rn
    s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
    else:
        z = tl.full((BLOCK_N,), 8.0, tl.float32)
    return s, z + 8388608.0


@triton.jit
def gemm_a(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, group_size, sxm, sqn, ssn, szn, som,
           K_PER_SPLIT, SPLIT: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # words loaded once per value (eight loads of each word, the same sectors), shifted by the column's place
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    shift = (rk % 8) * 4
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        words = tl.load(qw_ptr + rn[:, None] * sqn + ((k0 + rk) // 8)[None, :], mask=n_ok[:, None], other=0)
        s, zm = _scale_zero(s_ptr, z_ptr, rn, n_ok, k0 // group_size, ssn, szn, HAS_ZERO, BLOCK_N)
        qm = (((words >> shift[None, :]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        xt = tl.load(x_ptr + rm[None, :] * sxm + (k0 + rk)[:, None], mask=m_ok[None, :], other=0.0)
        w = ((qm - zm[:, None]) * s[:, None]).to(xt.dtype)
        if IEEE:
            acc += tl.dot(w, xt, input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
    split_k.finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


@triton.jit
def gemm_c(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, group_size, sxm, sqn, ssn, szn, som,
           K_PER_SPLIT, SPLIT: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x as the dot's A, the weight as B [BLOCK_K, BLOCK_N] built from words loaded once per value (GemLite's way)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    shift = (rk % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        words = tl.load(qw_ptr + rn[None, :] * sqn + ((k0 + rk) // 8)[:, None], mask=n_ok[None, :], other=0)
        s, zm = _scale_zero(s_ptr, z_ptr, rn, n_ok, k0 // group_size, ssn, szn, HAS_ZERO, BLOCK_N)
        qm = (((words >> shift[:, None]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        w = ((qm - zm[None, :]) * s[None, :]).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    split_k.finish_tile(tl.trans(acc), out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


@triton.jit
def gemm_d(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, group_size, sxm, sqn, ssn, szn, som,
           K_PER_SPLIT, SPLIT: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x as A, the weight as B: each word loaded once, its values joined, x's columns gathered in the same order
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = tl.arange(0, BLOCK_K // 8)
    c = tl.arange(0, BLOCK_K)
    rk = c
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        words = tl.load(qw_ptr + rn[:, None] * sqn + (k0 // 8 + rw)[None, :], mask=n_ok[:, None], other=0)
        s, zm = _scale_zero(s_ptr, z_ptr, rn, n_ok, k0 // group_size, ssn, szn, HAS_ZERO, BLOCK_N)
        dt = x.dtype
        w = w4a16_gemm._unpack(words, zm, s, dt, BLOCK_N, BLOCK_K)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    split_k.finish_tile(tl.trans(acc), out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


KERNELS = {"a": gemm_a, "c": gemm_c, "d": gemm_d}


def launch(variant, x, qweight, scales, out, part, count, config, split) -> None:
    m, k = x.shape
    n = qweight.shape[0]
    bm, bn, bk, warps, stages = config
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    if variant in ("pairs", "shifts"):
        w4a16_gemm._gemm[grid](x, qweight, scales, scales, out, part, count, m, n, k // scales.shape[1], x.stride(0),
                               qweight.stride(0), scales.stride(0), 0, out.stride(0), k // split, SPLIT=split,
                               HAS_ZERO=False, IEEE=False, PAIRS=int(variant == "pairs"), BLOCK_M=bm, BLOCK_N=bn,
                               BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return
    KERNELS[variant][grid](x, qweight, scales, scales, out, part, count, m, n, k, k // scales.shape[1], x.stride(0),
                           qweight.stride(0), scales.stride(0), 0, out.stride(0), k // split, SPLIT=split,
                           HAS_ZERO=False, IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                           num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--variants", default="pairs,shifts")
    parser.add_argument("--splits", default="1,4")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in LAYERS.items():
        nbytes = n * k // 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        ws = [(int4.pack_int4(torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)),
               (torch.rand(n, k // 128, device=dev) * 0.01 + 0.001).to(torch.bfloat16)) for _ in range(copies)]
        dense_copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
        dense = [int4.dequantize_int4(*ws[i % copies], None, torch.bfloat16) for i in range(dense_copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = F.linear(x.float(), dense[0].float())
            scale = ref.abs().max().item()
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            part = torch.zeros(m * n, device=dev, dtype=torch.float32)
            count = torch.zeros(4096, device=dev, dtype=torch.int32)
            turn = itertools.cycle(range(dense_copies))
            runs = {"cublas bf16": graph_us(lambda: torch.mm(x, dense[next(turn)].t(), out=out), calls=dense_copies)}
            turn = itertools.cycle(range(copies))
            runs["tree"] = graph_us(lambda: triton_w4a16.w4a16_matmul(x, *ws[next(turn)], None), calls=copies)
            turn = itertools.cycle(range(copies))  # the tree's GEMM at any row count (its own tile and split)
            runs["tree gemm"] = graph_us(lambda: w4a16_gemm.matmul(x, *ws[next(turn)], None, 128), calls=copies)
            turn = itertools.cycle(range(copies))
            runs["dequant+cublas"] = graph_us(
                lambda: F.linear(x, triton_w4a16.dequantize(*ws[next(turn)], None, torch.bfloat16)), calls=copies)
            errors = {}
            for v in args.variants.split(","):
                for config in CONFIGS[v]:
                    for split in [int(s) for s in args.splits.split(",")]:
                        tiles = triton.cdiv(n, config[1]) * triton.cdiv(m, config[0])
                        if split > 1 and tiles * split > 8 * 132:  # enough programs without a split
                            continue
                        tag = f"{v} {'x'.join(map(str, config))} s{split}"
                        try:
                            launch(v, x, *ws[0], out, part, count, config, split)
                            err = (out.float() - ref).abs().max().item() / scale
                            turn = itertools.cycle(range(copies))
                            us = graph_us(lambda: launch(v, x, *ws[next(turn)], out, part, count, config,
                                                         split), calls=copies)
                        except Exception as exc:  # noqa: BLE001  (a config that does not compile: say so, go on)
                            print(f"{name:8s} rows {m:4d} {tag:24s} failed: {type(exc).__name__}: {str(exc)[:160]}",
                                  flush=True)
                            continue
                        runs[tag], errors[tag] = us, err
            base = runs["cublas bf16"]
            for tag, us in sorted(runs.items(), key=lambda kv: kv[1]):
                flag = "  WRONG" if errors.get(tag, 0.0) > 0.02 else ""
                print(f"{name:8s} [{n}x{k}] rows {m:4d} {tag:24s} {us:8.1f} us  {base / us:5.2f}x cuBLAS"
                      f"  err {errors.get(tag, 0.0):.1e}{flag}", flush=True)
                results.append(dict(layer=name, n=n, k=k, rows=m, kind=tag, us=us, err=errors.get(tag)))
    print("\nms a step in the 36 layers' four linears (best config per layer; per variant):")
    kinds = sorted({r["kind"].split(" ")[0] if r["kind"].split(" ")[0] in CONFIGS else r["kind"] for r in results})
    for m in rows:
        line = []
        for kind in kinds:
            best = {}
            for r in results:
                key = r["kind"].split(" ")[0] if r["kind"].split(" ")[0] in CONFIGS else r["kind"]
                if r["rows"] == m and key == kind and (r["err"] is None or r["err"] <= 0.02):
                    best[r["layer"]] = min(best.get(r["layer"], 1e9), r["us"])
            if len(best) == len(LAYERS):
                line.append(f"{kind} {sum(best.values()) * 36 / 1000:.2f}")
        print(f"rows {m:4d}: " + ", ".join(line), flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gpu_w4a16_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
