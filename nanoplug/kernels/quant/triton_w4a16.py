"""Triton W4A16: activations in bfloat16/float16/float32 times int4 weights in `int4.py`'s layout (qweight
[N, K/8], scales and zeros [N, K/group]), dequantized per group in registers, float32 accumulation.

Two kernels here and a GEMM on tensor cores (w4a16_gemm.py) for the batches in between, with the weights rounded
to x's dtype as `dequantize_int4(..., x.dtype)` does: a GEMV for one row (decode), which multiplies float32 values
(q - zero) by x and each group's sums by its scale (`dequantize_int4(..., float32)` within float32 rounding; no
bfloat16 round trip a weight, one multiplication by the scale a group and row instead of a weight) and splits K
over programs in one launch (split_k.py) so a batch-1 step keeps the GPU's memory busy. From DEQUANT_ROWS rows on (big
batches, prefills) the weight is dequantized into a scratch in one pass and cuBLAS multiplies it: 2.5 bytes a weight more
of traffic, spread over that many rows, against a GEMM at the tensor cores' full rate. Each equals that
dequantization then a matmul within float32 rounding (tests/test_w4a16_kernels.py under TRITON_INTERPRET=1,
tests/gpu/test_gpu_w4a16.py in bfloat16).
"""
from __future__ import annotations

import torch

from nanoplug.api import import_triton
from nanoplug.kernels.quant import split_k as splits
from nanoplug.kernels.quant import w4a16_gemm

triton, tl, TRITON_ERROR = import_triton()  # where it fails, the plugin says why (TRITON_ERROR)
GEMV_ROWS = 1  # up to this many rows take the GEMV (from 2 rows the GEMM is the faster, as one read of the weight
# serves every row: benchmarks/studies/gpu_int4_tinygemm.py)
GEMV_BLOCK_N, GEMV_PROGRAMS, GEMV_SPLIT = 64, 4096, 8  # the GEMV's rows per program; K split until about this
# many programs run, in at most GEMV_SPLIT parts (benchmarks/studies/gpu_quant_gemv.py)
GEMV_WARPS = 4  # the GEMV's warps a program
DEQUANT_ROWS = 96  # from this many rows on, the weight is dequantized into a scratch and multiplied by cuBLAS
# (below it the GEMM is the faster: `benchmarks/studies/gpu_w4a16_dequant.py --crossover`)
DEQUANT_BLOCK_N, DEQUANT_WARPS = 32, 2  # the 16-bit dequantization's rows a program and warps (gpu_w4a16_dequant.py)


if triton is not None:
    @triton.jit
    def _tile(qw_ptr, s_ptr, z_ptr, rn, n_ok, k0, group_size, sqn, ssn, szn,
              HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # rows rn, columns k0 .. k0 + BLOCK_K of the weight in float32, as [BLOCK_N, BLOCK_K / 8, 8]: each int32
        # word loaded once and opened into its eight values along the last axis; (q - zero) * scale
        rw = tl.arange(0, BLOCK_K // 8)
        words = tl.load(qw_ptr + rn[:, None] * sqn + (k0 // 8 + rw)[None, :], mask=n_ok[:, None], other=0)
        q = ((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF).to(tl.float32)
        g = k0 // group_size
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        return (q - z[:, None, None]) * s[:, None, None]

    @triton.jit
    def _w4a16_gemv(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, N, K, group_size, sxm, sqn, ssn, szn,
                    som, K_PER_SPLIT, SPLIT: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        # 2-D tiles of whole words [BLOCK_N, BLOCK_K / 8] (one group a step), each word's eight values taken by
        # shifting in turn and multiplied by x as (q - zero); the step's sums are scaled once, not each weight.
        # K split over SPLIT programs in the same launch (split_k.py).
        row, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rw = tl.arange(0, BLOCK_K // 8)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            words = tl.load(qw_ptr + rn[:, None] * sqn + (k0 // 8 + rw)[None, :], mask=n_ok[:, None], other=0)
            g = k0 // group_size
            s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(z_ptr + rn * szn + g, mask=n_ok, other=0).to(tl.float32)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
            zm = z + 8388608.0  # 2^23: a 4-bit value OR-ed into 2^23's bits is 2^23 + q, no int-to-float convert
            step = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
            for j in tl.static_range(8):
                x = tl.load(x_ptr + row * sxm + k0 + rw * 8 + j).to(tl.float32)
                qm = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                step += (qm - zm[:, None]) * x[None, :]
            acc += step * s[:, None]
        splits.finish(tl.sum(acc, axis=1), out_ptr, part_ptr, count_ptr, row, rn, n_ok, N, som, SPLIT)

    @triton.jit
    def _w4a16_dequant(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, sqn, ssn, szn, son,
                       HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n, k0 = tl.program_id(0), tl.program_id(1) * BLOCK_K
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        w = _tile(qw_ptr, s_ptr, z_ptr, rn, n_ok, k0, group_size, sqn, ssn, szn, HAS_ZERO, BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(out_ptr + rn[:, None, None] * son + cols[None, :, :], w.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None, None])

    @triton.jit
    def _w4a16_dequant_pairs(qw_ptr, s_ptr, z_ptr, out_ptr, N, group_size, sqn, ssn, szn, son,
                             HAS_ZERO: tl.constexpr, FP16: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        # a [BLOCK_N, BLOCK_K] tile opened two values an instruction by the GEMM's PTX (w4a16_gemm._unpack_pairs):
        # (q - zero) * scale in the scales' 16-bit type with one rounding, as dequantize_int4 rounds its float32
        pid_n, k0 = tl.program_id(0), tl.program_id(1) * BLOCK_K
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        words, s, z = w4a16_gemm._group(qw_ptr, s_ptr, z_ptr, rn, n_ok, k0, group_size, sqn, ssn, szn, HAS_ZERO,
                                        BLOCK_N, BLOCK_K)
        w = w4a16_gemm._unpack_pairs(words, z, s, FP16, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + rn[:, None] * son + (k0 + tl.arange(0, BLOCK_K))[None, :], w, mask=n_ok[:, None])


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int4 on the GPU in one pass: the same values ((q - zero) * scale in float32, then `dtype`). In
    bfloat16 and float16 with scales of that type, the words are opened by the GEMM's PTX (2.5 TB/s on an H100
    against 1 TB/s by shifts in float32: benchmarks/studies/gpu_w4a16_dequant.py)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    group_size = k // scales.shape[1]
    bk = block_k(k, group_size)
    out = torch.empty(n, k, device=qweight.device, dtype=dtype)
    zero_arg, szn = (zeros, zeros.stride(0)) if zeros is not None else (scales, 0)
    pairs = w4a16_gemm.pair_type(dtype, scales)
    if pairs:
        _w4a16_dequant_pairs[(triton.cdiv(n, DEQUANT_BLOCK_N), k // bk)](
            qweight, scales, zero_arg, out, n, group_size, qweight.stride(0), scales.stride(0), szn, out.stride(0),
            HAS_ZERO=zeros is not None, FP16=pairs == 2, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=bk,
            num_warps=DEQUANT_WARPS)
        return out
    _w4a16_dequant[(triton.cdiv(n, 64), k // bk)](
        qweight, scales, zero_arg, out, n, k, group_size, qweight.stride(0), scales.stride(0), szn, out.stride(0),
        HAS_ZERO=zeros is not None, BLOCK_N=64, BLOCK_K=bk)
    return out


def block_k(k: int, group_size: int) -> int | None:
    """The K step both kernels take: it divides the group and K (None: no step of 16 to 128 does)."""
    for bk in (128, 64, 32, 16):
        if group_size % bk == 0 and k % bk == 0:
            return bk
    return None


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 split_k: int | None = None, block_n: int | None = None,
                 gemm: tuple[int, int, int, int, int] | None = None, warps: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_int4(qweight, scales, zeros).T -> [..., N] in x's dtype. `split_k`, `block_n`,
    `warps`: the GEMV's, `split_k` the GEMM's too (default: their own); `gemm`: the GEMM's tile
    (w4a16_gemm.config's)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    group_size = k // scales.shape[1]
    bk = block_k(k, group_size)
    zero_arg = zeros if zeros is not None else scales
    szn = zeros.stride(0) if zeros is not None else 0
    if m <= GEMV_ROWS:
        block_n = block_n or GEMV_BLOCK_N
        tiles, steps = triton.cdiv(n, block_n), k // bk
        if split_k is None:  # enough programs to keep the memory busy, at most GEMV_SPLIT each tile
            split_k = max(1, min(GEMV_SPLIT, steps, GEMV_PROGRAMS // (m * tiles)))
            while steps % split_k:
                split_k -= 1
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        part, count = splits.buffers(x.device, GEMV_ROWS * n, GEMV_ROWS * tiles) if split_k > 1 else (out, out)
        _w4a16_gemv[(m, tiles, split_k)](
            x2, qweight, scales, zero_arg, out, part, count, n, k, group_size, x2.stride(0), qweight.stride(0),
            scales.stride(0), szn, out.stride(0), k // split_k, SPLIT=split_k, HAS_ZERO=zeros is not None,
            BLOCK_N=block_n, BLOCK_K=bk, num_warps=warps or GEMV_WARPS)
    elif m >= DEQUANT_ROWS and x.dtype != torch.float32:  # a big batch: cuBLAS at full rate on the weight in bf16
        out = torch.nn.functional.linear(x2, dequantize(qweight, scales, zeros, x.dtype))
    else:
        out = w4a16_gemm.matmul(x2, qweight, scales, zeros, bk, gemm, split_k)
    return out.view(*shape[:-1], n)
