"""Triton kernels over GGUF weights in the layout of gguf_blocks.py: dequantize (rows, or rows gathered by
token id) and a GEMV for a row or two of activations; more rows multiply a dequantized copy.

A decode step streams every weight once, so the decode kernels read the quantized bytes directly and
never write a dequantized copy. Each program owns BLOCK_N output rows and walks the whole K in chunks
of BLOCK_G groups of 32; a group is handled as two halves of 16 (weights j and j + 16), which is how
the 4-bit formats store a byte's two nibbles, so no nibble is moved. On a GPU the quants become floats
by PRMT into 2^23's mantissa (inline PTX), not by the conversion instruction, whose quarter rate bounds
the GEMV. Sizes are constexpr and fixed (no
autotuning, no data-dependent host work): every launch can be captured in a CUDA graph. On a CPU they
run only under TRITON_INTERPRET=1 (the tests), with larger blocks (the interpreter pays per program).
"""
from __future__ import annotations

import torch

from nanoplug.api import import_triton, interpreting
from nanoplug.plugins.adapters.gguf_blocks import Packed

# where triton is missing or broken (TRITON_ERROR says why): the plugin says why, never a crash
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    # int8 / 4-bit quants to float32 without the conversion instruction (a quarter of the FMA rate on
    # Hopper, which bounds a GEMV): PRMT places each byte (sign bit flipped) or nibble in the low bits of
    # 2^23's mantissa and one subtraction leaves the exact integer. Four quants a PTX block (pack=4).
    _PRMT4 = """{
        .reg .b32 t, m;
        mov.b32 m, 0x4B000000;
        %s
        prmt.b32 $0, t, m, 0x7650;
        prmt.b32 $1, t, m, 0x7651;
        prmt.b32 $2, t, m, 0x7652;
        prmt.b32 $3, t, m, 0x7653;
        sub.f32 $0, $0, %s;
        sub.f32 $1, $1, %s;
        sub.f32 $2, $2, %s;
        sub.f32 $3, $3, %s;
    }"""
    _ASM_I8 = tl.constexpr(_PRMT4 % (("xor.b32 t, $4, 0x80808080;",) + ("0f4B000080",) * 4))  # q
    _ASM_LO = tl.constexpr(_PRMT4 % (("and.b32 t, $4, 0x0F0F0F0F;",) + ("0f4B000000",) * 4))  # q
    _ASM_HI = tl.constexpr(_PRMT4 % (("shr.b32 t, $4, 4; and.b32 t, t, 0x0F0F0F0F;",) + ("0f4B000000",) * 4))
    _ASM_LO8 = tl.constexpr(_PRMT4 % (("and.b32 t, $4, 0x0F0F0F0F;",) + ("0f4B000008",) * 4))  # q - 8 (Q4_0)
    _ASM_HI8 = tl.constexpr(_PRMT4 % (("shr.b32 t, $4, 4; and.b32 t, t, 0x0F0F0F0F;",) + ("0f4B000008",) * 4))

    @triton.jit
    def _asm4(b, ASM: tl.constexpr):
        return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [b], dtype=tl.float32, is_pure=True, pack=4)

    @triton.jit
    def _quants(q_ptr, rows64, g, mask3, G, IS_Q8: tl.constexpr, Q4_0: tl.constexpr, PTX: tl.constexpr):
        """Quants j and j + 16 (j < 16) of groups g of the rows, as float32 [BLOCK_N, BLOCK_G, 16] each
        (Q4_0's minus 8); PTX: by _asm4, else by the conversion instruction (the interpreter)."""
        j = tl.arange(0, 16)
        if IS_Q8:
            ptr = q_ptr + rows64[:, None, None] * (G * 32) + g[None, :, None] * 32 + j[None, None, :]
            lo = tl.load(ptr, mask=mask3, other=0)
            hi = tl.load(ptr + 16, mask=mask3, other=0)
            if PTX:
                return _asm4(lo, _ASM_I8), _asm4(hi, _ASM_I8)
            return lo.to(tl.float32), hi.to(tl.float32)
        ptr = q_ptr + rows64[:, None, None] * (G * 16) + g[None, :, None] * 16 + j[None, None, :]
        b = tl.load(ptr, mask=mask3, other=0)
        if PTX:
            if Q4_0:
                return _asm4(b, _ASM_LO8), _asm4(b, _ASM_HI8)
            return _asm4(b, _ASM_LO), _asm4(b, _ASM_HI)
        lo = (b & 0xF).to(tl.float32)
        hi = (b >> 4).to(tl.float32)
        if Q4_0:
            return lo - 8.0, hi - 8.0
        return lo, hi

    @triton.jit
    def _halves(q_ptr, s_ptr, m_ptr, rows, rmask, g, gmask, G,
                IS_Q8: tl.constexpr, Q4_0: tl.constexpr, HAS_MIN: tl.constexpr, PTX: tl.constexpr):
        """Weights j and j + 16 (j < 16) of groups g of `rows`, float32 [BLOCK_N, BLOCK_G, 16] each."""
        rows64 = rows.to(tl.int64)
        mask2 = rmask[:, None] & gmask[None, :]
        lo, hi = _quants(q_ptr, rows64, g, mask2[:, :, None], G, IS_Q8, Q4_0, PTX)
        soff = rows64[:, None] * G + g[None, :]
        s = tl.load(s_ptr + soff, mask=mask2, other=0).to(tl.float32)[:, :, None]
        lo = lo * s
        hi = hi * s
        if HAS_MIN:
            m = tl.load(m_ptr + soff, mask=mask2, other=0).to(tl.float32)[:, :, None]
            lo = lo + m
            hi = hi + m
        return lo, hi

    @triton.jit
    def _dequantize_kernel(q_ptr, s_ptr, m_ptr, ids_ptr, out_ptr, R, G, stride_o,
                           HAS_IDS: tl.constexpr, IS_Q8: tl.constexpr, Q4_0: tl.constexpr, HAS_MIN: tl.constexpr,
                           PTX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        """out[r] = weight row r (or row ids[r]), dequantized to out's dtype."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        if HAS_IDS:
            rows = tl.load(ids_ptr + r, mask=rmask, other=0)
        else:
            rows = r
        g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = g < G
        lo, hi = _halves(q_ptr, s_ptr, m_ptr, rows, rmask, g, gmask, G, IS_Q8, Q4_0, HAS_MIN, PTX)
        j = tl.arange(0, 16)
        ptr = out_ptr + r.to(tl.int64)[:, None, None] * stride_o + g[None, :, None] * 32 + j[None, None, :]
        mask = (rmask[:, None] & gmask[None, :])[:, :, None]
        tl.store(ptr, lo.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + 16, hi.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, N, G, stride_x, stride_o,
                     IS_Q8: tl.constexpr, Q4_0: tl.constexpr, HAS_MIN: tl.constexpr, PTX: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
        """out[m, n] = sum_k x[m, k] w[n, k] for one row m per program column, in float32: each group's dot
        product of quants and activations (its 16 + 16 terms in one thread) scaled once, not every weight;
        one reduction at the end (the weight tile is read once; the activations come from L1/L2)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        rows64 = rows.to(tl.int64)
        x_row = x_ptr + tl.program_id(1).to(tl.int64) * stride_x
        j = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
        for g0 in range(0, G, BLOCK_G):
            g = g0 + tl.arange(0, BLOCK_G)
            gmask = g < G
            xptr = x_row + g[:, None] * 32 + j[None, :]
            xlo = tl.load(xptr, mask=gmask[:, None], other=0).to(tl.float32)
            xhi = tl.load(xptr + 16, mask=gmask[:, None], other=0).to(tl.float32)
            mask2 = rmask[:, None] & gmask[None, :]
            qlo, qhi = _quants(q_ptr, rows64, g, mask2[:, :, None], G, IS_Q8, Q4_0, PTX)
            dot = tl.sum(qlo * xlo[None, :, :], axis=2) + tl.sum(qhi * xhi[None, :, :], axis=2)
            soff = rows64[:, None] * G + g[None, :]
            acc += dot * tl.load(s_ptr + soff, mask=mask2, other=0).to(tl.float32)
            if HAS_MIN:  # sum (d q + m) x = d sum q x + m sum x
                xsum = tl.sum(xlo, axis=1) + tl.sum(xhi, axis=1)
                acc += tl.load(m_ptr + soff, mask=mask2, other=0).to(tl.float32) * xsum[None, :]
        optr = out_ptr + tl.program_id(1).to(tl.int64) * stride_o + rows
        tl.store(optr, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rmask)


# (BLOCK_N, BLOCK_G, num_warps) of the GEMV per format and K (False: up to LONG_K columns, True: more): the
# fastest of `benchmarks/gpu_gguf.py kernels`'s sweep on an H200 (the 4-bit formats share Q4_1's)
GEMV_CONFIG = {("Q8_0", False): (2, 32, 1), ("Q8_0", True): (1, 64, 4),
               ("Q4_0", False): (8, 32, 2), ("Q4_0", True): (16, 128, 4),
               ("Q4_1", False): (8, 32, 2), ("Q4_1", True): (16, 128, 4),
               ("Q4_K", False): (8, 32, 2), ("Q4_K", True): (16, 128, 4)}
LONG_K = 8192
GEMV_MAX_M = 2  # rows of x the GEMV takes (it reads the weight once per row); above: dequantize + GEMM
DEQUANT_CONFIG = (16, 16, 4)   # BLOCK_R, BLOCK_G, num_warps


def _flags(p: Packed) -> dict:
    return dict(IS_Q8=p.fmt == "Q8_0", Q4_0=p.fmt == "Q4_0", HAS_MIN=p.mins is not None)


def _ptx() -> bool:
    """The inline-PTX conversions serve on a GPU; the interpreter takes the conversion instruction."""
    return not interpreting()


def _mins(p: Packed) -> torch.Tensor:
    return p.scales if p.mins is None else p.mins  # a pointer the kernel never reads when HAS_MIN is off


def dequantize(p: Packed, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Write weight rows (all, or rows `ids` in order) dequantized into out [R, cols] (rows contiguous)."""
    rows = p.rows if ids is None else ids.numel()
    block_r, block_g, warps = (64, 64, 4) if interpreting() else DEQUANT_CONFIG
    groups = p.cols // 32
    grid = (triton.cdiv(rows, block_r), triton.cdiv(groups, block_g))
    _dequantize_kernel[grid](p.quants, p.scales, _mins(p), ids if ids is not None else p.scales, out,
                             rows, groups, out.stride(0), HAS_IDS=ids is not None, **_flags(p), PTX=_ptx(),
                             BLOCK_R=block_r, BLOCK_G=block_g, num_warps=warps)
    return out


def gemv(x: torch.Tensor, p: Packed, out: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [M, rows] = x [M, cols] @ w.T, one program column per row of x (meant for M = 1)."""
    block_n, block_g, warps = config or ((256, 16, 4) if interpreting() else GEMV_CONFIG[p.fmt, p.cols > LONG_K])
    grid = (triton.cdiv(p.rows, block_n), x.shape[0])
    _gemv_kernel[grid](x, p.quants, p.scales, _mins(p), out, p.rows, p.cols // 32, x.stride(0), out.stride(0),
                       **_flags(p), PTX=_ptx(), BLOCK_N=block_n, BLOCK_G=block_g, num_warps=warps, num_stages=1)
    return out


def linear(x: torch.Tensor, p: Packed, out: torch.Tensor) -> torch.Tensor:
    """out [M, rows] = x [M, cols] @ w.T (x rows contiguous, out a view whose rows may be strided): the GEMV
    for one or two rows, else dequantize into a scratch of x's dtype and torch's GEMM (a fused tl.dot
    kernel for a few rows measured 3-10x slower than that on the H200: benchmarks/RESULTS.md)."""
    m = x.shape[0]
    if m <= GEMV_MAX_M:
        return gemv(x, p, out)
    w = dequantize(p, torch.empty(p.rows, p.cols, dtype=x.dtype, device=x.device))
    return torch.mm(x, w.t(), out=out) if out.is_contiguous() else out.copy_(torch.mm(x, w.t()))
