"""Triton kernels over GGUF weights in the layout of gguf_blocks.py: dequantize (rows, or rows gathered by
token id) and a GEMV for a row or two of activations; more rows multiply a dequantized copy.

A decode step streams every weight once, so the decode kernels read the quantized bytes directly and
never write a dequantized copy. Each program owns BLOCK_N output rows and walks the whole K in chunks
of BLOCK_G groups of 32, a group being 32 / (values a word) words whose values meet a contiguous run
of activations. Sizes are constexpr and fixed (no
autotuning, no data-dependent host work): every launch can be captured in a CUDA graph. On a CPU they
run only under TRITON_INTERPRET=1 (the tests), with larger blocks (the interpreter pays per program).
"""
from __future__ import annotations

import os

import torch

from nanoplug.plugins.adapters.gguf_blocks import Packed

try:
    import triton
    import triton.language as tl
except Exception as exc:  # triton missing or broken: the plugin says why, never a crash
    triton = None
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"
else:
    TRITON_ERROR = None

    @triton.jit
    def _values(q_ptr, s_ptr, m_ptr, rows, rmask, g, gmask, G, BITS: tl.constexpr, OFFSET: tl.constexpr):
        """Unscaled quants of groups g of `rows` as float32 [BLOCK_N, BLOCK_G, WORDS, PER] (value of weight
        g * 32 + w * PER + k), and the groups' scales (and mins) [BLOCK_N, BLOCK_G]. No int -> float
        conversion instruction (a quarter of the FMA rate): a value v < 2^8 or'ed into the bits of 2^23 is
        the float 2^23 + v, and one subtraction leaves v (minus the format's zero point, in OFFSET)."""
        PER: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = 32 // PER
        w = tl.arange(0, WORDS)
        k = tl.arange(0, PER)
        rows64 = rows.to(tl.int64)
        mask2 = rmask[:, None] & gmask[None, :]
        ptr = q_ptr + rows64[:, None, None] * (G * WORDS) + g[None, :, None] * WORDS + w[None, None, :]
        words = tl.load(ptr, mask=mask2[:, :, None], other=0)
        shifted = words[:, :, :, None] >> (k * BITS)[None, None, None, :]
        if BITS == 8:  # signed bytes: flipping the top bit makes q + 128, in 0..255
            bits = (shifted & 0xFF) ^ 0x4B000080
        else:
            bits = (shifted & 0xF) | 0x4B000000
        values = bits.to(tl.float32, bitcast=True) - OFFSET
        soff = rows64[:, None] * G + g[None, :]
        scale = tl.load(s_ptr + soff, mask=mask2, other=0).to(tl.float32)
        minimum = tl.load(m_ptr + soff, mask=mask2, other=0).to(tl.float32)
        return values, scale, minimum

    @triton.jit
    def _dequantize_kernel(q_ptr, s_ptr, m_ptr, ids_ptr, out_ptr, R, G, stride_o,
                           HAS_IDS: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        """out[r] = weight row r (or row ids[r]), dequantized to out's dtype."""
        PER: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = 32 // PER
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        if HAS_IDS:
            rows = tl.load(ids_ptr + r, mask=rmask, other=0)
        else:
            rows = r
        g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < G
        values, scale, minimum = _values(q_ptr, s_ptr, m_ptr, rows, rmask, g, gmask, G, BITS, OFFSET)
        out = values * scale[:, :, None, None]
        if HAS_MIN:
            out = out + minimum[:, :, None, None]
        w = tl.arange(0, WORDS)
        k = tl.arange(0, PER)
        col = g[:, None, None] * 32 + w[None, :, None] * PER + k[None, None, :]
        ptr = out_ptr + r.to(tl.int64)[:, None, None, None] * stride_o + col[None, :, :, :]
        mask = (rmask[:, None] & gmask[None, :])[:, :, None, None]
        tl.store(ptr, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, N, G, stride_x, stride_o,
                     BITS: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
        """out[m, n] = sum_k x[m, k] w[n, k] for one row m per program column. Per group: the unscaled
        dot product, then one multiply by its scale; a minimum adds min * (the group's sum of x), which
        every row of the program shares."""
        PER: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = 32 // PER
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        x_row = x_ptr + tl.program_id(1).to(tl.int64) * stride_x
        w = tl.arange(0, WORDS)
        k = tl.arange(0, PER)
        acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
        for g0 in range(0, G, BLOCK_G):
            g = g0 + tl.arange(0, BLOCK_G)
            gmask = g < G
            values, scale, minimum = _values(q_ptr, s_ptr, m_ptr, rows, rmask, g, gmask, G, BITS, OFFSET)
            xptr = x_row + g[:, None, None] * 32 + w[None, :, None] * PER + k[None, None, :]
            x = tl.load(xptr, mask=gmask[:, None, None], other=0).to(tl.float32)
            dots = tl.sum(tl.sum(values * x[None, :, :, :], axis=3), axis=2)
            acc += dots * scale
            if HAS_MIN:
                acc += minimum * tl.sum(tl.sum(x, axis=2), axis=1)[None, :]
        out = tl.sum(acc, axis=1)
        optr = out_ptr + tl.program_id(1).to(tl.int64) * stride_o + rows
        tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=rmask)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


# (BLOCK_N, BLOCK_G, num_warps) per format for the GEMV: the fastest of `benchmarks/gpu_gguf.py kernels`'s
# sweep on an H200 (many small programs in flight)
GEMV_CONFIG = {"Q8_0": (4, 8, 2), "Q4_0": (4, 8, 2), "Q4_1": (4, 8, 2), "Q4_K": (4, 8, 2)}
GEMV_MAX_M = 2  # rows of x the GEMV takes (it reads the weight once per row); above: dequantize + GEMM
DEQUANT_CONFIG = (16, 16, 4)   # BLOCK_R, BLOCK_G, num_warps


def _flags(p: Packed) -> dict:
    """BITS a value; OFFSET: 2^23 plus the zero point (Q8_0's bytes come out as q + 128, Q4_0's q is q - 8)."""
    offset = 8388608.0 + {"Q8_0": 128.0, "Q4_0": 8.0}.get(p.fmt, 0.0)
    return dict(BITS=8 if p.fmt == "Q8_0" else 4, OFFSET=offset, HAS_MIN=p.mins is not None)


def _mins(p: Packed) -> torch.Tensor:
    return p.scales if p.mins is None else p.mins  # a pointer the kernel never reads when HAS_MIN is off


def dequantize(p: Packed, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Write weight rows (all, or rows `ids` in order) dequantized into out [R, cols] (rows contiguous)."""
    rows = p.rows if ids is None else ids.numel()
    block_r, block_g, warps = (64, 64, 4) if interpreting() else DEQUANT_CONFIG
    groups = p.cols // 32
    grid = (triton.cdiv(rows, block_r), triton.cdiv(groups, block_g))
    _dequantize_kernel[grid](p.quants, p.scales, _mins(p), ids if ids is not None else p.scales, out,
                             rows, groups, out.stride(0), HAS_IDS=ids is not None, **_flags(p),
                             BLOCK_R=block_r, BLOCK_G=block_g, num_warps=warps)
    return out


def gemv(x: torch.Tensor, p: Packed, out: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [M, rows] = x [M, cols] @ w.T, one program column per row of x (meant for M = 1)."""
    block_n, block_g, warps = config or ((256, 16, 4) if interpreting() else GEMV_CONFIG[p.fmt])
    grid = (triton.cdiv(p.rows, block_n), x.shape[0])
    _gemv_kernel[grid](x, p.quants, p.scales, _mins(p), out, p.rows, p.cols // 32, x.stride(0), out.stride(0),
                       **_flags(p), BLOCK_N=block_n, BLOCK_G=block_g, num_warps=warps, num_stages=1)
    return out


def linear(x: torch.Tensor, p: Packed, out: torch.Tensor) -> torch.Tensor:
    """out [M, rows] = x [M, cols] @ w.T (x rows contiguous, out a view whose rows may be strided): the GEMV
    for one or two rows, else dequantize into a scratch of x's dtype and torch's GEMM (a fused tl.dot kernel
    for a few rows measured 3-10x slower than that on the H200: benchmarks/RESULTS.md)."""
    m = x.shape[0]
    if m <= GEMV_MAX_M:
        return gemv(x, p, out)
    w = dequantize(p, torch.empty(p.rows, p.cols, dtype=x.dtype, device=x.device))
    return torch.mm(x, w.t(), out=out) if out.is_contiguous() else out.copy_(torch.mm(x, w.t()))
