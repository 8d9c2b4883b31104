"""W4A16 GEMM candidates for 5-255 rows (issue 35's int4 bench: the tree's Triton GEMM runs at about 0.26x cuBLAS at 256
rows) on the 8B shape's four linears, each against cuBLAS on bf16 weights of the same shape, the tree's own int4
path and dequantize-then-cuBLAS, over enough weight copies that none is read from L2 (calls in one CUDA graph):

- a: the weight as the dot's A operand (out^T = W @ x^T: the weight's rows fill the 64-row wgmma, a few batch rows
  its N), words loaded once per value (eight loads of each word) and shifted by the value's place;
- b: as a, each word loaded once and its eight values joined along new axes (no repeated loads);
- c: x as A, the weight as B, words loaded once per value (GemLite's layout);
- d: as c, words loaded once and joined;
- e, f: b and d with the values opened two at a time by Marlin's lop3 trick (inline PTX) and scaled in bfloat16;
- g: e with the zero's subtraction and the scale's product in the PTX too, on pairs (bf16x2).

Each result is checked against dequantize-then-matmul (bf16 weights, float32 sums). Split K adds the programs' float32
tiles in shared partials, the last program of a tile writing it (as split_k.py does for the GEMVs).

    python3 benchmarks/studies/gpu_w4a16_gemm.py [--rows 16,64,128,256] [--variants a,b,c,d]
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

from nanoplug.kernels.quant import int4, triton_w4a16, w4a16_gemm

triton, tl = triton_w4a16.triton, triton_w4a16.tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402  (calls captured in one CUDA graph, the median replay)
from gpu_quant_kernels import LAYERS  # noqa: E402  (the 8B shape's four linears)
from studies.gpu_row_invariance import L2_DEFEAT_BYTES  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried per variant
CONFIGS = {
    "a": [(16, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4)],
    "b": [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 128, 128, 4, 3), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3),
          (256, 128, 64, 8, 3)],
    "c": [(16, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4)],
    "d": [(16, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)],
    "e": [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 128, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3),
          (128, 64, 128, 4, 3), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3)],
    "f": [(16, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)],
    "g": [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3)],
    "h": [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 128, 4, 3), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3),
          (256, 64, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 4), (128, 64, 64, 4, 4)],
}



@triton.jit
def _finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT: tl.constexpr):
    out = out_ptr + rm[None, :] * som + rn[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        cols = part_ptr + rm[None, :] * N + rn[:, None]
        tl.atomic_add(cols, acc, mask=mask)
        tl.debug_barrier()
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(count_ptr + tile, 1) == SPLIT - 1:
            nothing = tl.zeros(acc.shape, tl.float32)
            done = tl.where(mask, tl.atomic_add(cols, nothing, mask=mask), 0.0)
            tl.store(out, done.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(cols, nothing, mask=mask)
            tl.store(count_ptr + tile, 0)


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
        g = k0 // group_size
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        zm = z + 8388608.0
        qm = (((words >> shift[None, :]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        xt = tl.load(x_ptr + rm[None, :] * sxm + (k0 + rk)[:, None], mask=m_ok[None, :], other=0.0)
        w = ((qm - zm[:, None]) * s[:, None]).to(xt.dtype)
        if IEEE:
            acc += tl.dot(w, xt, input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
    _finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


@triton.jit
def _val(words, j: tl.constexpr, zm, s, dtype: tl.constexpr):
    qm = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    return ((qm - zm[:, None]) * s[:, None]).to(dtype)


@triton.jit
def _unpack(words, zm, s, dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # [BLOCK_N, BLOCK_K / 8] words -> [BLOCK_N, BLOCK_K] values in their own order: joins pick bit 2, then 1, then 0
    # of a value's place in its word, so the flattened axis is 8 * word + place
    e = tl.join(tl.join(_val(words, 0, zm, s, dt), _val(words, 4, zm, s, dt)),
                tl.join(_val(words, 2, zm, s, dt), _val(words, 6, zm, s, dt)))
    o = tl.join(tl.join(_val(words, 1, zm, s, dt), _val(words, 5, zm, s, dt)),
                tl.join(_val(words, 3, zm, s, dt), _val(words, 7, zm, s, dt)))
    return tl.reshape(tl.join(e, o), (BLOCK_N, BLOCK_K))


@triton.jit
def gemm_b(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, group_size, sxm, sqn, ssn, szn, som,
           K_PER_SPLIT, SPLIT: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # each word loaded once, its eight values joined along a new axis; x's rows gathered in the same order
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = tl.arange(0, BLOCK_K // 8)
    c = tl.arange(0, BLOCK_K)
    rk = c
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        words = tl.load(qw_ptr + rn[:, None] * sqn + (k0 // 8 + rw)[None, :], mask=n_ok[:, None], other=0)
        g = k0 // group_size
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        zm = z + 8388608.0
        xt = tl.load(x_ptr + rm[None, :] * sxm + (k0 + rk)[:, None], mask=m_ok[None, :], other=0.0)
        dt = xt.dtype
        w = _unpack(words, zm, s, dt, BLOCK_N, BLOCK_K)
        if IEEE:
            acc += tl.dot(w, xt, input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
    _finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


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
        g = k0 // group_size
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        zm = z + 8388608.0
        qm = (((words >> shift[:, None]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        w = ((qm - zm[None, :]) * s[None, :]).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    _finish_tile(tl.trans(acc), out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


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
        g = k0 // group_size
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        zm = z + 8388608.0
        dt = x.dtype
        w = _unpack(words, zm, s, dt, BLOCK_N, BLOCK_K)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    _finish_tile(tl.trans(acc), out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


@triton.jit
def _unpack_asm(words, zm, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Marlin's trick for bfloat16: (word >> 4i) & 0x000f000f | 0x43004300 is two bfloat16 128 + q (values i and i + 4)
    # in one lop3; then (v - (128 + zero)) * scale in bfloat16, exact but for the product's one rounding (as
    # dequantize_int4's float32 product rounded to bfloat16)
    v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, t2, t3, s1, s2, s3;
        shr.b32 s1, $8, 4;
        shr.b32 s2, $8, 8;
        shr.b32 s3, $8, 12;
        lop3.b32 t0, $8, 0x000f000f, 0x43004300, 0xea;
        lop3.b32 t1, s1, 0x000f000f, 0x43004300, 0xea;
        lop3.b32 t2, s2, 0x000f000f, 0x43004300, 0xea;
        lop3.b32 t3, s3, 0x000f000f, 0x43004300, 0xea;
        mov.b32 {$0, $4}, t0;
        mov.b32 {$1, $5}, t1;
        mov.b32 {$2, $6}, t2;
        mov.b32 {$3, $7}, t3;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[words], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    zb = zm[:, None]
    sb = s[:, None]
    e = tl.join(tl.join((v0 - zb) * sb, (v4 - zb) * sb), tl.join((v2 - zb) * sb, (v6 - zb) * sb))
    o = tl.join(tl.join((v1 - zb) * sb, (v5 - zb) * sb), tl.join((v3 - zb) * sb, (v7 - zb) * sb))
    return tl.reshape(tl.join(e, o), (BLOCK_N, BLOCK_K))


@triton.jit
def _unpack_asm2(words, zm, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # _unpack_asm with the zero's subtraction and the scale's product in the asm too, two values a bf16x2 op
    zb = tl.broadcast_to(zm[:, None], words.shape)
    sb = tl.broadcast_to(s[:, None], words.shape)
    v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, t2, t3, s1, s2, s3, zz, ss;
        mov.b32 zz, {$9, $9};
        mov.b32 ss, {$10, $10};
        shr.b32 s1, $8, 4;
        shr.b32 s2, $8, 8;
        shr.b32 s3, $8, 12;
        lop3.b32 t0, $8, 0x000f000f, 0x43004300, 0xea;
        lop3.b32 t1, s1, 0x000f000f, 0x43004300, 0xea;
        lop3.b32 t2, s2, 0x000f000f, 0x43004300, 0xea;
        lop3.b32 t3, s3, 0x000f000f, 0x43004300, 0xea;
        sub.rn.bf16x2 t0, t0, zz;
        sub.rn.bf16x2 t1, t1, zz;
        sub.rn.bf16x2 t2, t2, zz;
        sub.rn.bf16x2 t3, t3, zz;
        mul.rn.bf16x2 t0, t0, ss;
        mul.rn.bf16x2 t1, t1, ss;
        mul.rn.bf16x2 t2, t2, ss;
        mul.rn.bf16x2 t3, t3, ss;
        mov.b32 {$0, $4}, t0;
        mov.b32 {$1, $5}, t1;
        mov.b32 {$2, $6}, t2;
        mov.b32 {$3, $7}, t3;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", args=[words, zb, sb], dtype=(tl.bfloat16,) * 8,
        is_pure=True, pack=1)
    e = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    o = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(e, o), (BLOCK_N, BLOCK_K))


@triton.jit
def gemm_e(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, group_size, sxm, sqn, ssn, szn, som,
           K_PER_SPLIT, SPLIT: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
           ASM2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # b (SWAP) or d with the values opened by _unpack_asm or _unpack_asm2 (bfloat16 x and scales only)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = tl.arange(0, BLOCK_K // 8)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        words = tl.load(qw_ptr + rn[:, None] * sqn + (k0 // 8 + rw)[None, :], mask=n_ok[:, None], other=0)
        g = k0 // group_size
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0)
        if HAS_ZERO:
            zm = (tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32) + 128.0).to(tl.bfloat16)
        else:
            zm = tl.full((BLOCK_N,), 136.0, tl.bfloat16)
        if ASM2:
            w = _unpack_asm2(words, zm, s, BLOCK_N, BLOCK_K)
        else:
            w = _unpack_asm(words, zm, s, BLOCK_N, BLOCK_K)
        if SWAP:
            xt = tl.load(x_ptr + rm[None, :] * sxm + (k0 + rk)[:, None], mask=m_ok[None, :], other=0.0)
            acc += tl.dot(w, xt)
        else:
            x = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w))
    if SWAP:
        _finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)
    else:
        _finish_tile(tl.trans(acc), out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


KERNELS = {"a": gemm_a, "b": gemm_b, "c": gemm_c, "d": gemm_d, "e": gemm_e, "f": gemm_e, "g": gemm_e, "h": gemm_e}


def launch(kernel_name, x, qweight, scales, out, part, count, config, split) -> None:
    kernel = KERNELS[kernel_name]
    m, k = x.shape
    n = qweight.shape[0]
    bm, bn, bk, warps, stages = config
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    kernel[grid](x, qweight, scales, scales, out, part, count, m, n, k, k // scales.shape[1], x.stride(0),
                 qweight.stride(0), scales.stride(0), 0, out.stride(0), k // split, SPLIT=split, HAS_ZERO=False,
                 IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                 **({"SWAP": kernel_name != "f", "ASM2": kernel_name in "gh"} if kernel_name in "efgh" else {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64,128,256")
    parser.add_argument("--variants", default="a,b,c,d,e,f,g")
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
    kinds = sorted({r["kind"].split(" ")[0] if r["kind"][0] in KERNELS and r["kind"][1] == " " else r["kind"]
                    for r in results})
    for m in rows:
        line = []
        for kind in kinds:
            best = {}
            for r in results:
                key = r["kind"].split(" ")[0] if r["kind"][0] in KERNELS and r["kind"][1] == " " else r["kind"]
                if r["rows"] == m and key == kind and (r["err"] is None or r["err"] <= 0.02):
                    best[r["layer"]] = min(best.get(r["layer"], 1e9), r["us"])
            if len(best) == len(LAYERS):
                line.append(f"{kind} {sum(best.values()) * 36 / 1000:.2f}")
        print(f"rows {m:4d}: " + ", ".join(line), flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gpu_w4a16_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
