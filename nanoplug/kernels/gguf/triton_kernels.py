"""Triton kernels over GGUF weights in the layout of gguf_blocks.py: dequantize (rows, or rows gathered by
token id) and a GEMV for a row or two of activations; more rows multiply a dequantized copy.

A decode step streams every weight once, so the decode kernels read the quantized bytes directly and
never write a dequantized copy. Each program owns BLOCK_N output rows and walks the whole K in chunks
of BLOCK_G groups of 32; a group is handled as two halves of 16 (weights j and j + 16), which is how
the 4-bit formats store a byte's two nibbles, so no nibble is moved. Two GEMVs: on float activations
(quants become floats by PRMT into 2^23's mantissa, inline PTX, not by the conversion instruction,
whose quarter rate bounds the GEMV), and on activations quantized to int8 a group of 32, as llama.cpp's
MMVQ does (dp4a: a few integer instructions a group; what a 4-bit format needs to outrun bf16).
Sizes are constexpr and fixed (no autotuning, no data-dependent host work): every launch can be
captured in a CUDA graph. On a CPU they run only under TRITON_INTERPRET=1 (the tests), with larger
blocks (the interpreter pays per program) and float activations.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from nanoplug.api import import_triton, interpreting
from nanoplug.kernels.gguf.blocks import Packed

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
    def _raw_quants(q_ptr, rows64, g, mask3, G, IS_Q8: tl.constexpr):
        """The bytes of quants j and j + 16 (j < 16) of groups g of the rows, [BLOCK_N, BLOCK_G, 16] each (a
        4-bit format's byte holds both: the second is a one-element placeholder)."""
        j = tl.arange(0, 16)
        if IS_Q8:
            ptr = q_ptr + rows64[:, None, None] * (G * 32) + g[None, :, None] * 32 + j[None, None, :]
            return tl.load(ptr, mask=mask3, other=0), tl.load(ptr + 16, mask=mask3, other=0)
        else:  # (both branches spelled out: Triton types each return, and these differ)
            ptr = q_ptr + rows64[:, None, None] * (G * 16) + g[None, :, None] * 16 + j[None, None, :]
            return tl.load(ptr, mask=mask3, other=0), tl.zeros([1], dtype=tl.uint8)

    @triton.jit
    def _floats(a, b, IS_Q8: tl.constexpr, Q4_0: tl.constexpr, PTX: tl.constexpr):
        """_raw_quants' bytes as float32 quants j and j + 16 (Q4_0's minus 8); PTX: by _asm4, else by the
        conversion instruction (the interpreter)."""
        if IS_Q8:
            if PTX:
                return _asm4(a, _ASM_I8), _asm4(b, _ASM_I8)
            return a.to(tl.float32), b.to(tl.float32)
        if PTX:
            if Q4_0:
                return _asm4(a, _ASM_LO8), _asm4(a, _ASM_HI8)
            return _asm4(a, _ASM_LO), _asm4(a, _ASM_HI)
        lo = (a & 0xF).to(tl.float32)
        hi = (a >> 4).to(tl.float32)
        if Q4_0:
            return lo - 8.0, hi - 8.0
        return lo, hi

    @triton.jit
    def _halves(q_ptr, s_ptr, m_ptr, rows, rmask, g, G,
                IS_Q8: tl.constexpr, Q4_0: tl.constexpr, HAS_MIN: tl.constexpr, PTX: tl.constexpr):
        """Weights j and j + 16 (j < 16) of groups g of `rows`, float32 [BLOCK_N, BLOCK_G, 16] each."""
        a, b, s, mn = _tile(q_ptr, s_ptr, m_ptr, rows.to(tl.int64), rmask, g, G, IS_Q8, HAS_MIN, False)
        lo, hi = _floats(a, b, IS_Q8, Q4_0, PTX)
        s = s.to(tl.float32)[:, :, None]
        lo = lo * s
        hi = hi * s
        if HAS_MIN:
            m = mn.to(tl.float32)[:, :, None]
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
        lo, hi = _halves(q_ptr, s_ptr, m_ptr, rows, rmask, g, G, IS_Q8, Q4_0, HAS_MIN, PTX)
        j = tl.arange(0, 16)
        ptr = out_ptr + r.to(tl.int64)[:, None, None] * stride_o + g[None, :, None] * 32 + j[None, None, :]
        mask = (rmask[:, None] & gmask[None, :])[:, :, None]
        tl.store(ptr, lo.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + 16, hi.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tile(q_ptr, s_ptr, m_ptr, rows64, rmask, g, G, IS_Q8: tl.constexpr, HAS_MIN: tl.constexpr,
              INT8: tl.constexpr):
        """What the GEMV reads of the weight for groups g, as stored: quants (bytes, or int32 words for the GEMV
        on int8 activations), scales, mins (HAS_MIN)."""
        gmask = g < G
        mask2 = rmask[:, None] & gmask[None, :]
        if INT8:
            a, b = _words(q_ptr, rows64, g, mask2[:, :, None], G, IS_Q8)
        else:
            a, b = _raw_quants(q_ptr, rows64, g, mask2[:, :, None], G, IS_Q8)
        soff = rows64[:, None] * G + g[None, :]
        s = tl.load(s_ptr + soff, mask=mask2, other=0)
        if HAS_MIN:
            return a, b, s, tl.load(m_ptr + soff, mask=mask2, other=0)
        return a, b, s, s

    @triton.jit
    def _tile_dot(x_row, a, b, s, mn, g, G, IS_Q8: tl.constexpr, Q4_0: tl.constexpr, HAS_MIN: tl.constexpr,
                  PTX: tl.constexpr):
        """[BLOCK_N, BLOCK_G]: each group's dot product with the activations, its 16 + 16 terms in one thread,
        scaled once (plus its minimum times the activations' sum: sum (d q + m) x = d sum q x + m sum x)."""
        j = tl.arange(0, 16)
        gmask = g < G
        xptr = x_row + g[:, None] * 32 + j[None, :]
        xlo = tl.load(xptr, mask=gmask[:, None], other=0).to(tl.float32)
        xhi = tl.load(xptr + 16, mask=gmask[:, None], other=0).to(tl.float32)
        qlo, qhi = _floats(a, b, IS_Q8, Q4_0, PTX)
        dot = tl.sum(qlo * xlo[None, :, :], axis=2) + tl.sum(qhi * xhi[None, :, :], axis=2)
        dot = dot * s.to(tl.float32)
        if HAS_MIN:
            dot += mn.to(tl.float32) * (tl.sum(xlo, axis=1) + tl.sum(xhi, axis=1))[None, :]
        return dot

    # ------------------------------------------------------------ the GEMV on int8 activations (dp4a)
    _ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: added to a float under 2^22, leaves it rounded in the mantissa

    @triton.jit
    def _dp4a(a, b, c, PTX: tl.constexpr):
        """c + the dot product of a's and b's four signed bytes (int32 words), elementwise."""
        if PTX:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        for i in tl.static_range(4):
            c += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return c

    @triton.jit
    def _exact_int(f):
        """The integer-valued float32 f (|f| < 2^22) as int32, by the mantissa, not the conversion instruction."""
        return (f + _ROUND).to(tl.int32, bitcast=True) - 0x4B400000

    @triton.jit
    def _exact_float(i):
        """int32 i (|i| < 2^22) as float32, by the mantissa."""
        return (i + 0x4B400000).to(tl.float32, bitcast=True) - _ROUND

    @triton.jit
    def _int8_words(x, inv):
        """x [BLOCK_G, 4, 4] times inv (per group), rounded to int8, four to an int32 word: [BLOCK_G, 4], and
        the sum of the int8 values a group."""
        q = _exact_int(x * inv[:, None, None])
        shift = (tl.arange(0, 4) * 8)[None, None, :]
        return tl.sum((q & 0xFF) << shift, axis=2), tl.sum(tl.sum(q, axis=2), axis=1)

    @triton.jit
    def _words(q_ptr, rows64, g, mask3, G, IS_Q8: tl.constexpr):
        """The quants of groups g of the rows as int32 words [BLOCK_N, BLOCK_G, 4]: Q8_0's first and second
        16; a 4-bit format's 16 bytes (word k: quants 4k..4k+3 low, 4k+16.. high), then a placeholder."""
        k = tl.arange(0, 4)
        w_ptr = q_ptr.to(tl.pointer_type(tl.int32))
        if IS_Q8:
            ptr = w_ptr + rows64[:, None, None] * (G * 8) + g[None, :, None] * 8 + k[None, None, :]
            return tl.load(ptr, mask=mask3, other=0), tl.load(ptr + 4, mask=mask3, other=0)
        else:
            ptr = w_ptr + rows64[:, None, None] * (G * 4) + g[None, :, None] * 4 + k[None, None, :]
            return tl.load(ptr, mask=mask3, other=0), tl.zeros([1], dtype=tl.int32)

    @triton.jit
    def _word_tile_dot(x_row, a, b, s, mn, g, G, IS_Q8: tl.constexpr, Q4_0: tl.constexpr,
                       HAS_MIN: tl.constexpr, PTX: tl.constexpr):
        """[BLOCK_N, BLOCK_G]: each group's dot product with the activations quantized to int8 (scale: the
        group's largest |x| / 127), as llama.cpp's MMVQ does: eight dp4a a group and row, no quant becomes a
        float; the result is exactly the dequantized weights times the dequantized activations, in float32."""
        gmask = g < G
        k = tl.arange(0, 4)
        xptr = x_row + g[:, None, None] * 32 + k[None, :, None] * 4 + k[None, None, :]
        xlo = tl.load(xptr, mask=gmask[:, None, None], other=0).to(tl.float32)
        xhi = tl.load(xptr + 16, mask=gmask[:, None, None], other=0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(xlo), axis=2), axis=1), tl.max(tl.max(tl.abs(xhi), axis=2), axis=1))
        inv = 127.0 / tl.maximum(amax, 1e-30)  # a group of zeros: any inv gives zeros
        wlo, slo = _int8_words(xlo, inv)
        whi, shi = _int8_words(xhi, inv)
        dx = amax / 127.0
        if IS_Q8:
            lo, hi = a, b
        else:
            lo = a & 0x0F0F0F0F
            hi = (a >> 4) & 0x0F0F0F0F
        isum = tl.sum(_dp4a(hi, whi[None, :, :], _dp4a(lo, wlo[None, :, :], tl.zeros_like(lo), PTX), PTX), axis=2)
        xsum = slo + shi
        if Q4_0:  # (q - 8) . x = q . x - 8 sum x
            isum -= 8 * xsum[None, :]
        dot = _exact_float(isum) * (s.to(tl.float32) * dx[None, :])
        if HAS_MIN:
            dot += mn.to(tl.float32) * (dx * _exact_float(xsum))[None, :]
        return dot

    @triton.jit
    def _chunk(x_row, q_ptr, s_ptr, m_ptr, rows64, rmask, g, G, IS_Q8: tl.constexpr, Q4_0: tl.constexpr,
               HAS_MIN: tl.constexpr, PTX: tl.constexpr, INT8: tl.constexpr):
        """[BLOCK_N, BLOCK_G]: the groups g of the rows times the activations, in float32."""
        a, b, s, mn = _tile(q_ptr, s_ptr, m_ptr, rows64, rmask, g, G, IS_Q8, HAS_MIN, INT8)
        if INT8:
            return _word_tile_dot(x_row, a, b, s, mn, g, G, IS_Q8, Q4_0, HAS_MIN, PTX)
        else:
            return _tile_dot(x_row, a, b, s, mn, g, G, IS_Q8, Q4_0, HAS_MIN, PTX)

    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, ids_ptr, N, G, stride_x, stride_o, X_DIV,
                     IS_Q8: tl.constexpr, Q4_0: tl.constexpr, HAS_MIN: tl.constexpr, PTX: tl.constexpr,
                     INT8: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                     K_GROUPS: tl.constexpr):
        """out[m, n] = sum_k x[m // X_DIV, k] w[n, k] for one row m per program column, in float32, one reduction
        at the end (the weight tile is read once; the activations come from L1/L2). INT8: the activations
        quantized to int8 a group of 32, each program quantizing the groups it reads (no extra launch), a
        few integer instructions a group where float activations take a few a weight. K_GROUPS (K / 32, or
        0: K at run time): the loop unrolled at compile time, which some tiles prefer. EXPERTS: the weight is
        experts of N rows each, stacked, and row m takes expert ids[m]'s."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        rows64 = rows.to(tl.int64)
        if EXPERTS:
            rows64 += tl.load(ids_ptr + tl.program_id(1)).to(tl.int64) * N
        x_row = x_ptr + (tl.program_id(1) // X_DIV).to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
        if K_GROUPS:
            for g0 in tl.static_range(0, K_GROUPS, BLOCK_G):
                acc += _chunk(x_row, q_ptr, s_ptr, m_ptr, rows64, rmask, g0 + tl.arange(0, BLOCK_G), G,
                              IS_Q8, Q4_0, HAS_MIN, PTX, INT8)
        else:
            for g0 in range(0, G, BLOCK_G):
                acc += _chunk(x_row, q_ptr, s_ptr, m_ptr, rows64, rmask, g0 + tl.arange(0, BLOCK_G), G,
                              IS_Q8, Q4_0, HAS_MIN, PTX, INT8)
        optr = out_ptr + tl.program_id(1).to(tl.int64) * stride_o + rows
        tl.store(optr, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rmask)


class GemvConfig(NamedTuple):
    """The GEMV's tiles (BLOCK_N rows x BLOCK_G groups a program, its warps), whether its K loop is unrolled,
    and its activations' type. (Triton's num_stages pipelines no load here.)"""
    block_n: int
    block_g: int
    warps: int
    unroll: bool = False  # the K loop unrolled (a kernel per K; some tiles are faster so)
    int8: bool = False  # activations quantized to int8 a group of 32 (dp4a), else float32


# per format and K (False: up to LONG_K columns, True: more): the fastest of `benchmarks/gpu_gguf.py kernels`'s
# sweep on an H200, weighted by a decoded token's calls (the 4-bit formats share Q4_1's); Q8_0's int8 GEMV
# is no faster than its float one there, so it keeps float activations
GEMV_CONFIG = {("Q8_0", False): GemvConfig(2, 32, 1, unroll=True), ("Q8_0", True): GemvConfig(4, 64, 2),
               **{(fmt, False): GemvConfig(16, 64, 4, int8=True) for fmt in ("Q4_0", "Q4_1", "Q4_K")},
               **{(fmt, True): GemvConfig(16, 128, 8, unroll=True, int8=True) for fmt in ("Q4_0", "Q4_1", "Q4_K")}}
INTERPRETER_GEMV = GemvConfig(256, 16, 4)  # the interpreter pays per program: few, large ones
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


def gemv(x: torch.Tensor, p: Packed, out: torch.Tensor, config: GemvConfig | None = None,
         experts: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """out [M, rows] = x [M, cols] @ w.T, one program column per row of x (meant for M = 1). `experts` (ids,
    x_div): p is experts stacked, out [len(ids), p.rows / experts] and row m is x[m // x_div] times expert
    ids[m]'s rows (an MoE's (token, slot) pairs)."""
    c = config or (INTERPRETER_GEMV if interpreting() else GEMV_CONFIG[p.fmt, p.cols > LONG_K])
    ids, x_div = experts if experts is not None else (p.scales, 1)  # (a pointer the kernel never reads)
    rows = out.shape[1] if experts is not None else p.rows
    grid = (triton.cdiv(rows, c.block_n), out.shape[0])
    _gemv_kernel[grid](x, p.quants, p.scales, _mins(p), out, ids, rows, p.cols // 32, x.stride(0), out.stride(0),
                       x_div, **_flags(p), PTX=_ptx(), INT8=c.int8, EXPERTS=experts is not None,
                       BLOCK_N=c.block_n, BLOCK_G=c.block_g, K_GROUPS=p.cols // 32 if c.unroll else 0,
                       num_warps=c.warps, num_stages=1)
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
