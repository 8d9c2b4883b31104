"""The W4A16 GEMM on tensor cores for batches between the GEMV's few rows and the dequantize-then-cuBLAS path
(triton_w4a16.py dispatches). Each program computes a transposed tile, out^T = W @ x^T: the weight's rows fill the
tensor cores' wide side and the batch's rows their narrow one, so 5 or 16 rows waste no 64-row instruction. Each
int32 word of the weight is loaded once (pipelined copies) and its eight values opened (two at a time by PTX in
bfloat16 and float16, by shifts in float32) and joined along new axes in the word's own order, which leaves the tile
in registers for the dot; the values are those of `dequantize_int4(..., x.dtype)`, so the product equals that
dequantization then a matmul within float32 rounding. K is split over programs (split_k.finish_tile) when the tiles
alone would leave SMs idle."""
from __future__ import annotations

import os

import torch

from nanoplug.api import import_triton
from nanoplug.kernels.quant import split_k as splits

triton, tl, TRITON_ERROR = import_triton()
# tiles (BLOCK_M, BLOCK_N, BLOCK_K at most, warps, stages) by rows, for weights below and from BIG values
# (benchmarks/studies/gpu_w4a16_gemm.py: the kernel is bound by latency more than by its ALU work, so many small
# programs win up to 64 rows but on the biggest layers)
SMALL, MID, LARGE, HUGE = (16, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3)
BIG = 32 << 20
PAIR_TYPES = {torch.bfloat16: 1, torch.float16: 2}  # the 16-bit types whose values are opened two at a time (PTX)
PAIRS_ON = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter cannot run PTX: float32 path there
PROGRAMS, MAX_SPLIT = 264, 4  # K split until about this many programs run (two per SM of an H100), in at most 4


def _pairs_asm(magic: str, one: str, op: str) -> str:
    """PTX opening one int32 word ($8) into its eight values ($0-$7) in a 16-bit type, Marlin's way: (word >> 4i)
    & 0x000f000f | MAGIC is the pair (MAGIC + q) of values i and i + 4 (128 + q in bfloat16, 1024 + q in float16:
    q fills the mantissa's low bits); less (MAGIC + zero) ($9) exactly, times the scale ($10) with one rounding:
    the float32 path's values. fma serves the subtraction (times one) and the product (plus -0): SM80 has no
    bf16x2 sub or mul."""
    lines = ["mov.b32 zz, {$9, $9};", "mov.b32 ss, {$10, $10};", "xor.b32 zz, zz, 0x80008000;",
             f"mov.b32 one, {one};", "mov.b32 mz, 0x80008000;",
             "shr.b32 s1, $8, 4;", "shr.b32 s2, $8, 8;", "shr.b32 s3, $8, 12;",
             f"lop3.b32 t0, $8, 0x000f000f, {magic}, 0xea;"]
    lines += [f"lop3.b32 t{i}, s{i}, 0x000f000f, {magic}, 0xea;" for i in (1, 2, 3)]
    lines += [f"{op} t{i}, t{i}, one, zz;" for i in range(4)] + [f"{op} t{i}, t{i}, ss, mz;" for i in range(4)]
    lines += [f"mov.b32 {{${i}, ${i + 4}}}, t{i};" for i in range(4)]
    return "{\n.reg .b32 t0, t1, t2, t3, s1, s2, s3, zz, ss, one, mz;\n" + "\n".join(lines) + "\n}"


if triton is not None:
    _ASM_BF16 = tl.constexpr(_pairs_asm("0x43004300", "0x3F803F80", "fma.rn.bf16x2"))
    _ASM_FP16 = tl.constexpr(_pairs_asm("0x64006400", "0x3C003C00", "fma.rn.f16x2"))
    _CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,h,h")

    @triton.jit
    def _value(words, j: tl.constexpr, zm, s, dtype: tl.constexpr):
        # value j of each word: 2^23 + q by OR-ing q into 2^23's bits (no int-to-float convert), less 2^23 + zero,
        # times the scale in float32 (exact), rounded once to x's dtype
        qm = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        return ((qm - zm[:, None]) * s[:, None]).to(dtype)

    @triton.jit
    def _unpack(words, zm, s, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # [BLOCK_N, BLOCK_K / 8] words -> [BLOCK_N, BLOCK_K] values: the joins pick bit 2, then 1, then 0 of a
        # value's place in its word, so the flattened axis is 8 * word + place, the columns' own order
        e = tl.join(tl.join(_value(words, 0, zm, s, dtype), _value(words, 4, zm, s, dtype)),
                    tl.join(_value(words, 2, zm, s, dtype), _value(words, 6, zm, s, dtype)))
        o = tl.join(tl.join(_value(words, 1, zm, s, dtype), _value(words, 5, zm, s, dtype)),
                    tl.join(_value(words, 3, zm, s, dtype), _value(words, 7, zm, s, dtype)))
        return tl.reshape(tl.join(e, o), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _unpack_pairs(words, z, s, FP16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Marlin's way, two values an instruction (_pairs_asm); z: the zeros in float32, s: the scales in the 16-bit
        # type the values come out in
        zm = (z + (1024.0 if FP16 else 128.0)).to(s.dtype)  # MAGIC + zero, exact in that type
        zb = tl.broadcast_to(zm[:, None], words.shape)
        sb = tl.broadcast_to(s[:, None], words.shape)
        if FP16:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                asm=_ASM_FP16, constraints=_CONSTRAINTS, args=[words, zb, sb], dtype=(tl.float16,) * 8,
                is_pure=True, pack=1)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                asm=_ASM_BF16, constraints=_CONSTRAINTS, args=[words, zb, sb], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
        e = tl.join(tl.join(v0, v4), tl.join(v2, v6))
        o = tl.join(tl.join(v1, v5), tl.join(v3, v7))
        return tl.reshape(tl.join(e, o), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _group(qw_ptr, s_ptr, z_ptr, rn, n_ok, k0, group_size, sqn, ssn, szn, HAS_ZERO: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # rows rn's words of columns k0 .. k0 + BLOCK_K (within one group), their group's scales (the checkpoint's
        # type) and zeros (float32; 8 without a zero point)
        words = tl.load(qw_ptr + rn[:, None] * sqn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :],
                        mask=n_ok[:, None], other=0)
        g = k0 // group_size
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        return words, s, z

    @triton.jit
    def _gemm(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, group_size, sxm, sqn, ssn, szn, som,
              K_PER_SPLIT, SPLIT: tl.constexpr, HAS_ZERO: tl.constexpr, IEEE: tl.constexpr, PAIRS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok, m_ok = rn < N, rm < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):  # BLOCK_K divides the group: one group a step
            words, s, z = _group(qw_ptr, s_ptr, z_ptr, rn, n_ok, k0, group_size, sqn, ssn, szn, HAS_ZERO, BLOCK_N,
                                 BLOCK_K)
            xt = tl.load(x_ptr + rm[None, :] * sxm + (k0 + rk)[:, None], mask=m_ok[None, :], other=0.0)
            if PAIRS:  # x and the scales in the same 16-bit type
                w = _unpack_pairs(words, z, s, PAIRS == 2, BLOCK_N, BLOCK_K)
            else:
                w = _unpack(words, z + 8388608.0, s.to(tl.float32), xt.dtype, BLOCK_N, BLOCK_K)
            if IEEE:
                acc += tl.dot(w, xt, input_precision="ieee")
            else:
                acc += tl.dot(w, xt)
        splits.finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT)


def pair_type(dtype: torch.dtype, scales: torch.Tensor) -> int:
    """The kernels' PAIRS code for values of `dtype` from these scales: 1 bfloat16, 2 float16 (opened by PTX, which
    takes the scales in that type), 0 the float32 shifts (any other case, and always under the interpreter)."""
    return PAIR_TYPES.get(dtype, 0) if PAIRS_ON and scales.dtype == dtype else 0


def config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """The tile (BLOCK_M, BLOCK_N, BLOCK_K at most, warps, stages) for m rows times an [n, k] weight."""
    big = n * k >= BIG
    if m <= 16:
        return SMALL
    if m <= 64:
        return MID if big else SMALL
    return HUGE if big else LARGE


def matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, block_k: int,
           tile: tuple[int, int, int, int, int] | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ dequantize_int4(qweight, scales, zeros, x.dtype).T -> [M, N] in x's dtype;
    `block_k` divides the group and K; `tile`, `split_k`: instead of config() and the split that fills the GPU."""
    m, k = x.shape
    n = qweight.shape[0]
    block_m, block_n, bk_max, warps, stages = tile or config(m, n, k)
    bk = min(block_k, bk_max)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    steps = k // bk
    if split_k is None:
        split_k = max(1, min(MAX_SPLIT, steps, PROGRAMS // tiles))
        while steps % split_k:
            split_k -= 1
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part, count = splits.buffers(x.device, m * n, tiles) if split_k > 1 else (out, out)
    pairs = pair_type(x.dtype, scales)
    _gemm[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)](
        x, qweight, scales, zeros if zeros is not None else scales, out, part, count, m, n, k // scales.shape[1],
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0, out.stride(0),
        k // split_k, SPLIT=split_k, HAS_ZERO=zeros is not None, IEEE=x.dtype == torch.float32, PAIRS=pairs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out
