"""Triton fp8 for block-scaled checkpoints (DeepSeek / Qwen3-FP8: e4m3 weights [N, K], one float32 scale per
[bn, bk] block): activations quantized to e4m3 per token and group of `bk` columns at run time (scale =
max(amax, 1e-10) / 448, as vLLM's `per_token_group_quant_fp8`), then

- a GEMM on fp8 tensor cores (the pattern of vLLM's `w8a8_block_fp8_matmul`): per K block one fp8 tl.dot,
  scaled by the row's activation scale and the weight block's scale, float32 accumulation;
- a GEMV for a few rows (decode) that quantizes its slice of activations itself (no extra launch) and reads
  the weights once at fp8's byte per weight, K split over programs in the same launch (split_k.py) when N alone
  cannot fill the GPU.

Both compute sum_k xq[m, k] * sx[m, g(k)] * wq[n, k] * sw[n // bn, g(k)]: dequantize-then-matmul with the
activations rounded to e4m3 (tests/test_fp8_block_kernels.py under TRITON_INTERPRET=1, tests/gpu/ on the GPU).
"""
from __future__ import annotations

import torch

from nanoplug.api import import_triton
from nanoplug.kernels.quant import split_k as splits

triton, tl, TRITON_ERROR = import_triton()  # where it fails, the linear method says why (TRITON_ERROR)
FP8_MAX = 448.0
EPS = 1e-10  # vLLM's: a group of zeros keeps a positive scale
GEMV_ROWS = 4  # up to this many rows take the GEMV
# the GEMV's rows a program at one activation row and at more, and its warps (benchmarks/studies/gpu_quant_gemv.py)
GEMV_BLOCK_N, GEMV_BLOCK_N_ROWS, GEMV_WARPS = 16, 32, 1
GEMV_PROGRAMS, GEMV_SPLIT = 2048, 8  # K is split until this many programs run, in at most GEMV_SPLIT parts
# the GEMM's BLOCK_M, BLOCK_N (a divisor of the blocks' rows), warps and stages, below and from 1024 rows
GEMM_CONFIG, GEMM_CONFIG_LARGE = (64, 128, 4, 4), (128, 128, 8, 3)


if triton is not None:
    @triton.jit
    def _group_quant(x_ptr, q_ptr, s_ptr, M, K, sxm, ssm, ssg, G: tl.constexpr):
        row, g = tl.program_id(0), tl.program_id(1)
        cols = g * G + tl.arange(0, G)
        ok = cols < K
        # rows from M on (padding a caller asked for) read as zeros: q 0, scale 1e-10 / 448
        x = tl.load(x_ptr + row * sxm + cols, mask=cols < tl.where(row < M, K, 0), other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x)), 1e-10) / 448.0
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row * ssm + g * ssg, scale)

    @triton.jit
    def _block_gemm(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, bn, sbn, scm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # a [M, K] fp8 contiguous, as [M, ceil(K/BLOCK_K)]; b [N, K] fp8 contiguous, bs [ceil(N/bn), sbn];
        # BLOCK_K is the scales' block along K, BLOCK_N divides bn
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        groups = tl.cdiv(K, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_scale_row = (pid_n * BLOCK_N) // bn
        for g in range(0, groups):
            kk = g * BLOCK_K + rk
            k_ok = kk < K
            a = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr + rn[None, :] * K + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            a_s = tl.load(as_ptr + rm * groups + g, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptr + b_scale_row * sbn + g)
            acc += tl.dot(a, b) * a_s[:, None] * b_s
        tl.store(c_ptr + rm[:, None] * scm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _block_gemv(x_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, N, K, bn, sxm, swn, som, K_PER_SPLIT,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        # BLOCK_K is the scales' block along K and the activations' group; BLOCK_N divides bn. The activations'
        # group is a [1, BLOCK_K] tile, its amax a reduction within a warp (one warp a program: no barrier but
        # the tile's move into the weights' layout); each step's products are summed within a thread's 16
        # columns, the rows' sums taken once at the end
        row, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        w_scale_row = (pid_n * BLOCK_N) // bn
        k_start = pid_k * K_PER_SPLIT
        for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            x = tl.load(x_ptr + row * sxm + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)[:, None] / 448.0
            xq = tl.clamp(x / x_scale, -448.0, 448.0).to(w_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w_s = tl.load(ws_ptr + w_scale_row * swn + k0 // BLOCK_K)
            step = w.to(tl.float32) * (xq * (x_scale * w_s))
            acc += tl.sum(tl.reshape(step, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
        splits.finish(tl.sum(acc, axis=1), out_ptr, part_ptr, count_ptr, row, rn, n_ok, N, som, SPLIT)


def group_quant(x: torch.Tensor, group: int, token_major: bool = False,
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/group)]) with x ~= q * scale per group; `token_major`:
    the scales laid out a group's tokens together (strides (1, M)), as cuBLAS's block-scaled GEMM reads them;
    `rows` (at least M): that many rows out, the ones past M zeros (padding without a copy of x)."""
    m, k = x.shape
    rows = rows or m
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t() if token_major else torch.empty(
        rows, groups, dtype=torch.float32, device=x.device)
    _group_quant[(rows, groups)](x, q, s, m, k, x.stride(0), s.stride(0), s.stride(1), G=group)
    return q, s


def supported(n: int, k: int, block: tuple[int, int]) -> str | None:
    """Why the kernels cannot take this weight's blocks (None: they can)."""
    bn, bk = block
    if bk not in (32, 64, 128, 256) or bn % 16:
        return f"its [{bn}, {bk}] blocks are not served (bk a power of two 32-256, bn a multiple of 16)"
    if k % 16:
        return f"its {k} input columns are not a multiple of 16"
    return None


def _block_n(bn: int, cap: int) -> int:
    return next(b for b in (cap, 64, 32, 16) if b <= cap and bn % b == 0)


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     split_k: int | None = None, block_n: int | None = None,
                     gemm: tuple[int, int, int, int] | None = None, warps: int | None = None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] e4m3 * scale [ceil(N/bn), ceil(K/bk)] per block).T -> [..., N] in x's dtype,
    x quantized to e4m3 per token and group of bk columns. `split_k`, `block_n`, `warps`: the GEMV's (default:
    its own)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    bn, bk = block
    if m <= GEMV_ROWS:
        block_n = _block_n(bn, block_n or (GEMV_BLOCK_N if m == 1 else GEMV_BLOCK_N_ROWS))
        groups = triton.cdiv(k, bk)
        if split_k is None:  # enough programs to fill the GPU (132 SMs, several programs each)
            split_k = 1
            while (m * triton.cdiv(n, block_n) * split_k < GEMV_PROGRAMS and split_k < GEMV_SPLIT
                   and groups % (split_k * 2) == 0):
                split_k *= 2
        tiles = triton.cdiv(n, block_n)
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        part, count = splits.buffers(x.device, GEMV_ROWS * n, GEMV_ROWS * tiles) if split_k > 1 else (out, out)
        _block_gemv[(m, tiles, split_k)](
            x2, weight, scale, out, part, count, n, k, bn, x2.stride(0), scale.stride(0), out.stride(0),
            triton.cdiv(groups, split_k) * bk, BLOCK_N=block_n, BLOCK_K=bk, SPLIT=split_k,
            num_warps=warps or GEMV_WARPS)
    else:
        xq, xs = group_quant(x2, bk)
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        block_m, block_n, warps, stages = gemm or (
            (16, 64, 4, 3) if m <= 16 else GEMM_CONFIG if m < 1024 else GEMM_CONFIG_LARGE)
        block_n = _block_n(bn, block_n)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _block_gemm[grid](xq, weight, out, xs, scale, m, n, k, bn, scale.stride(0), out.stride(0),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out.view(*shape[:-1], n)
