"""Dense linear layers on CUDA: `x @ W.T + b` by a Triton kernel when x has one row (batch-1 decode), or two rows
(batch-2 decode) or as many as a one-sequence verification of speculative drafts brings and a small weight, by
cuBLAS otherwise.

At one or two rows a linear layer only streams its weight; cuBLAS's kernels for these shapes leave much of
the GPU's memory bandwidth unused on the small matrices of a decoder layer (benchmarks/RESULTS.md). The
kernel gives each program a few output rows, reads their weight rows once in wide coalesced chunks along K,
and accumulates in float32 for every row of x at once. A row's result does not depend on the rows beside it
(tests/gpu/test_gpu_row_invariance.py): so where a model's every layer takes it, a verification's rows equal
one-row decode steps bit for bit, and greedy speculative decoding at batch 1 gives the plain engine's tokens in
bf16, where cuBLAS's (its kernels chosen by the row count) would not. Past the small weights the kernel at 4-8
rows costs 1.3-2.5x cuBLAS's time (benchmarks/studies/gpu_row_invariance.py), more than speculation gains.
On a CPU the kernel runs only under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import DenseLinearMethod, import_triton, interpreting, wide_linear

# where triton is missing or broken (TRITON_ERROR says why): every layer stays on cuBLAS
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _small_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                           M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Rows [pid * BLOCK_N, +BLOCK_N) of y's columns for all M (<= M_PAD) rows of x, in float32."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, M_PAD)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < M
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            else:
                k_ok = kk < K
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

MAX_ROWS = 2  # from three rows on, cuBLAS is as fast or faster on a decoder layer's shapes
# at two rows cuBLAS wins from a Qwen3-0.6B layer's q/k/v or gate/up weight up (4M elements; an 8B's every layer)
MAX_WEIGHT_AT_TWO_ROWS = 1 << 22


def _blocks(k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a reduction of length k: a whole row of up to 4,096 in one chunk (two rows a
    program then), longer rows in chunks of 2,048 (four rows a program). The best or within 3% of the best of a
    sweep on the H200 over Qwen3-0.6B's and 8B's layers and LM heads (benchmarks/studies/gpu_gemv_tune.py), but
    for the 0.6B's LM head (78.6 us against 71.6 with eight rows a program)."""
    if k > 4096:
        return 4, 2048
    block_k = triton.next_power_of_2(k)
    return (2 if block_k == 4096 and k == block_k else 4), block_k


MAX_VERIFY_ROWS = 8  # a verification of up to 7 drafts


def verify_rows(decode_query_len: int) -> int:
    """The rows a one-sequence verification step's products have: its 1 + k query rows, padded as its decode graph
    pads them (to a power of two); 1 without a speculator (or past MAX_VERIFY_ROWS: cuBLAS, not bit-equal)."""
    rows = triton.next_power_of_2(decode_query_len) if triton is not None else 1
    return rows if 1 < rows <= MAX_VERIFY_ROWS else 1


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, verify: int = 1) -> bool:
    """Whether the kernel computes this product (else cuBLAS): one row of a half-precision x, or two (or up to
    `verify`: a verification's) and a small weight; a weight of the same dtype with contiguous rows."""
    if triton is None or x.dim() != 2 or weight.dim() != 2 or (x.device.type != "cuda" and not interpreting()):
        return False
    rows, n = x.shape[0], weight.shape[0]
    small = rows == 1 or n * weight.shape[1] < MAX_WEIGHT_AT_TWO_ROWS
    return (0 < rows <= max(MAX_ROWS, verify) and small and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.stride(1) == 1
            and weight.stride(1) == 1 and x.shape[1] == weight.shape[1]
            and (bias is None or (bias.dim() == 1 and bias.is_contiguous() and bias.shape[0] == n)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, verify: int = 1) -> torch.Tensor:
    """F.linear(x, weight, bias), by the kernel where `takes` says so; out_dtype float32: the kernel's float32
    accumulators unrounded (the LM head's logits), `wide_linear` where the kernel does not take it."""
    if not takes(x, weight, bias, verify):
        if out_dtype == torch.float32 and x.dtype != torch.float32:
            y = wide_linear(x, weight)
            return y if bias is None else y + bias.float()
        return F.linear(x, weight, bias)
    (rows, k), n = x.shape, weight.shape[0]
    y = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k = _blocks(k)
    _small_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        M_PAD=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, num_warps=4, num_stages=2)
    return y


class SmallBatchLinearMethod(DenseLinearMethod):
    """Dense weights as the default method holds them; one- and two-row products by the kernel above, and small
    weights' products of up to `verify` rows (`verify_rows`: an engine that verifies drafts) too. The LM head's
    float32 logits keep the one- and two-row rule: unrounded, a row's logits differ from its one-row ones by
    float32 noise, far below a bf16 step, and the kernel at 8 rows of a vocabulary costs 2-4x cuBLAS's time."""

    def __init__(self, verify: int = 1):
        self.verify = verify

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return linear(x, layer.weight, bias, verify=self.verify)
        return linear(x.reshape(-1, x.shape[-1]), layer.weight, bias, verify=self.verify).reshape(*x.shape[:-1], -1)

    def apply_float32(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or layer.weight.dtype != x.dtype:
            return super().apply_float32(layer, x)
        return linear(x.reshape(-1, x.shape[-1]), layer.weight, None, torch.float32).reshape(*x.shape[:-1], -1)
