"""Triton kernels over GGUF weights kept in the file's own blocks: Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS (super-blocks
of 256) and Q5_0, Q5_1, IQ4_NL (blocks of 32). The weight on the GPU is the file's bytes [rows, row bytes],
unchanged, so it keeps the file's bits per weight.

Every format is read as chunks of 32 weights: a program gathers the bytes of BLOCK_C chunks of BLOCK_N
rows (quants, high bits, scales, float16 factors) and computes each weight in float32 in gguf-py's order
((d * scale) * q - dmin * min), so a dequantized row equals gguf-py's under the interpreter (on a GPU the
compiler may fuse a multiply and an add). Two kernels: dequantize (rows, or rows gathered by token id),
and a GEMV for a row or two of activations that never writes the weights out; more rows multiply a
dequantized copy with torch's GEMM. Sizes are constexpr and fixed: every launch can be captured in a
CUDA graph. On a CPU they run only under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from nanoplug.api import import_triton, interpreting

FORMATS = {"Q5_0": 6, "Q5_1": 7, "Q2_K": 10, "Q3_K": 11, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}
BLOCK_BYTES = {"Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18), "Q2_K": (256, 84), "Q3_K": (256, 110),
               "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_XS": (256, 136)}
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4's 16 values


class RawBlocks(NamedTuple):
    """One quantized weight [rows, cols] as the file's blocks (uint8 [rows, row bytes])."""

    fmt: str
    rows: int
    cols: int
    data: torch.Tensor

    def to(self, device: torch.device) -> "RawBlocks":
        return self._replace(data=self.data.to(device).contiguous())

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def raw_blocks(fmt: str, blocks: torch.Tensor, rows: int, cols: int) -> RawBlocks:
    """uint8 blocks [rows, bytes per row] as in the file -> the kernels' weight (the same bytes, contiguous)."""
    per, size = BLOCK_BYTES[fmt]
    if cols % per:
        raise ValueError(f"a {fmt} weight needs rows of whole blocks of {per}; it has {cols} columns")
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (rows, cols // per * size):
        raise ValueError(f"{fmt} blocks of a [{rows}, {cols}] weight are uint8 [{rows}, {cols // per * size}], "
                         f"not {blocks.dtype} {list(blocks.shape)}")
    return RawBlocks(fmt, rows, cols, blocks.contiguous())


triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _u8(ptr, off, mask):
        return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _half(ptr, off, mask):
        """The float16 at byte offset `off` (little endian), as float32."""
        v = _u8(ptr, off, mask) | (_u8(ptr, off + 1, mask) << 8)
        return v.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _weights(w_ptr, kv_ptr, rows64, rmask, c, C, RB, FMT: tl.constexpr, TS: tl.constexpr, QS: tl.constexpr):
        """Weights of chunks c (32 each) of the rows: float32 [BLOCK_N, BLOCK_C, 32], gguf-py's values (TS: bytes
        a block; QS: where a block of 32's quants start)."""
        m2 = rmask[:, None] & (c < C)[None, :]
        m3 = m2[:, :, None]
        l = tl.arange(0, 32)[None, None, :]
        if FMT == 14 or FMT == 13 or FMT == 11 or FMT == 10 or FMT == 23:  # super-blocks of 256
            s = (c % 8)[None, :]
            blk = rows64[:, None] * RB + (c // 8)[None, :].to(tl.int64) * TS
            b3 = blk[:, :, None]
            s3 = s[:, :, None]
            j = 2 * s3 + l // 16  # the sub-block of 16
            if FMT == 14:  # Q6_K: ql[128] qh[64] scales[16] d
                ql = (_u8(w_ptr, b3 + 64 * (s3 // 4) + 32 * (s3 % 2) + l, m3) >> (4 * ((s3 % 4) // 2))) & 0xF
                qh = (_u8(w_ptr, b3 + 128 + 32 * (s3 // 4) + l, m3) >> (2 * (s3 % 4))) & 3
                sc = _u8(w_ptr, b3 + 192 + j, m3).to(tl.int8).to(tl.float32)
                dl = _half(w_ptr, blk + 208, m2)[:, :, None] * sc
                return dl * ((ql | (qh << 4)) - 32).to(tl.float32)
            elif FMT == 13:  # Q5_K: d dmin scales[12] qh[32] qs[128]
                ql = (_u8(w_ptr, b3 + 48 + 32 * (s3 // 2) + l, m3) >> (4 * (s3 % 2))) & 0xF
                qh = (_u8(w_ptr, b3 + 16 + l, m3) >> s3) & 1
                qa = _u8(w_ptr, blk + 4 + s, m2)
                qb = _u8(w_ptr, blk + 8 + s, m2)
                qc = _u8(w_ptr, blk + tl.maximum(s, 4), m2)  # q[j - 4] for j >= 4
                sc = tl.where(s < 4, qa & 63, (qb & 0xF) | ((qc >> 6) << 4)).to(tl.float32)
                mn = tl.where(s < 4, qb & 63, (qb >> 4) | ((qa >> 6) << 4)).to(tl.float32)
                d = (_half(w_ptr, blk, m2) * sc)[:, :, None]
                dm = (_half(w_ptr, blk + 2, m2) * mn)[:, :, None]
                return d * (ql | (qh << 4)).to(tl.float32) - dm
            elif FMT == 11:  # Q3_K: hmask[32] qs[64] scales[12] d
                qh = (_u8(w_ptr, b3 + l, m3) >> s3) & 1
                ql = (_u8(w_ptr, b3 + 32 + 32 * (s3 // 4) + l, m3) >> (2 * (s3 % 4))) & 3
                lo = (_u8(w_ptr, b3 + 96 + j % 8, m3) >> (4 * (j // 8))) & 0xF
                hi = (_u8(w_ptr, b3 + 104 + j % 4, m3) >> (2 * (j // 4))) & 3
                sc = ((lo | (hi << 4)) - 32).to(tl.float32)
                dl = _half(w_ptr, blk + 108, m2)[:, :, None] * sc
                return dl * ((ql | (qh << 2)) - 4).to(tl.float32)
            elif FMT == 10:  # Q2_K: scales[16] qs[64] d dmin
                q = (_u8(w_ptr, b3 + 16 + 32 * (s3 // 4) + l, m3) >> (2 * (s3 % 4))) & 3
                scm = _u8(w_ptr, b3 + j, m3)
                dl = _half(w_ptr, blk + 80, m2)[:, :, None] * (scm & 0xF).to(tl.float32)
                ml = _half(w_ptr, blk + 82, m2)[:, :, None] * (scm >> 4).to(tl.float32)
                return dl * q.to(tl.float32) - ml
            else:  # IQ4_XS: d scales_h(16 bits) scales_l[4] qs[128]
                nib = (_u8(w_ptr, b3 + 8 + 16 * s3 + l % 16, m3) >> (4 * (l // 16))) & 0xF
                sh = _u8(w_ptr, blk + 2, m2) | (_u8(w_ptr, blk + 3, m2) << 8)
                ls = ((_u8(w_ptr, blk + 4 + s // 2, m2) >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4)
                dl = (_half(w_ptr, blk, m2) * (ls - 32).to(tl.float32))[:, :, None]
                return dl * tl.load(kv_ptr + nib).to(tl.float32)
        else:  # blocks of 32: the chunk is the block
            blk = rows64[:, None] * RB + c[None, :].to(tl.int64) * TS
            b3 = blk[:, :, None]
            d = _half(w_ptr, blk, m2)[:, :, None]
            nib = (_u8(w_ptr, b3 + QS + l % 16, m3) >> (4 * (l // 16))) & 0xF
            if FMT == 20:  # IQ4_NL: d qs[16]
                return d * tl.load(kv_ptr + nib).to(tl.float32)
            else:
                hb = (_u8(w_ptr, b3 + QS - 4 + l // 8, m3) >> (l % 8)) & 1
                q = nib | (hb << 4)
                if FMT == 6:  # Q5_0: d qh[4] qs[16]
                    return d * (q - 16).to(tl.float32)
                else:  # Q5_1: d m qh[4] qs[16]
                    return d * q.to(tl.float32) + _half(w_ptr, blk + 2, m2)[:, :, None]

    @triton.jit
    def _dequantize_kernel(w_ptr, kv_ptr, ids_ptr, out_ptr, R, C, RB, stride_o, HAS_IDS: tl.constexpr,
                           FMT: tl.constexpr, TS: tl.constexpr, QS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """out[r] = weight row r (or row ids[r]), dequantized to out's dtype."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        if HAS_IDS:
            rows = tl.load(ids_ptr + r, mask=rmask, other=0)
        else:
            rows = r
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        w = _weights(w_ptr, kv_ptr, rows.to(tl.int64), rmask, c, C, RB, FMT, TS, QS)
        l = tl.arange(0, 32)
        ptr = out_ptr + r.to(tl.int64)[:, None, None] * stride_o + c[None, :, None] * 32 + l[None, None, :]
        tl.store(ptr, w.to(out_ptr.dtype.element_ty), mask=(rmask[:, None] & (c < C)[None, :])[:, :, None])

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, kv_ptr, out_ptr, ids_ptr, N, C, RB, stride_x, stride_o, X_DIV, FMT: tl.constexpr,
                     TS: tl.constexpr, QS: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_C: tl.constexpr):
        """out[m, n] = sum_k x[m // X_DIV, k] w[n, k], one row m per program column, float32 sums. EXPERTS: the
        weight is experts of N rows each, stacked, and row m takes expert ids[m]'s."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        rows64 = rows.to(tl.int64)
        if EXPERTS:
            rows64 += tl.load(ids_ptr + tl.program_id(1)).to(tl.int64) * N
        x_row = x_ptr + (tl.program_id(1) // X_DIV).to(tl.int64) * stride_x
        l = tl.arange(0, 32)
        acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            w = _weights(w_ptr, kv_ptr, rows64, rmask, c, C, RB, FMT, TS, QS)
            x = tl.load(x_row + c[:, None] * 32 + l[None, :], mask=(c < C)[:, None], other=0).to(tl.float32)
            acc += tl.sum(w * x[None, :, :], axis=2)
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * stride_o + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty),
                 mask=rmask)


GEMV_CONFIG = (32, 4, 4)        # BLOCK_N, BLOCK_C, num_warps on a GPU
INTERPRETER_CONFIG = (64, 8)    # the interpreter pays per program: few, large ones
GEMV_MAX_M = 2  # rows of x the GEMV takes; above: dequantize + torch's GEMM
_KV: dict[torch.device, torch.Tensor] = {}
_QS = {"Q5_0": 6, "Q5_1": 8, "IQ4_NL": 2}


def _consts(w: RawBlocks) -> dict:
    return dict(FMT=FORMATS[w.fmt], TS=BLOCK_BYTES[w.fmt][1], QS=_QS.get(w.fmt, 0))


def _kvalues(device: torch.device) -> torch.Tensor:
    if device not in _KV:
        _KV[device] = torch.tensor(KVALUES, dtype=torch.int8, device=device)
    return _KV[device]


def dequantize(w: RawBlocks, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Write weight rows (all, or rows `ids` in order) dequantized into out [R, cols] (rows contiguous)."""
    rows = w.rows if ids is None else ids.numel()
    block_r, block_c = INTERPRETER_CONFIG if interpreting() else (16, 8)
    chunks = w.cols // 32
    grid = (triton.cdiv(rows, block_r), triton.cdiv(chunks, block_c))
    _dequantize_kernel[grid](w.data, _kvalues(w.data.device), ids if ids is not None else w.data, out, rows, chunks,
                             w.data.shape[1], out.stride(0), HAS_IDS=ids is not None, **_consts(w),
                             BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out


def gemv(x: torch.Tensor, w: RawBlocks, out: torch.Tensor,
         experts: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """out [M, rows] = x [M, cols] @ w.T, one program column per row of x (meant for M <= 2). `experts` (ids,
    x_div): w is experts stacked, out [len(ids), w.rows / experts] and row m is x[m // x_div] times expert
    ids[m]'s rows (an MoE's (token, slot) pairs)."""
    if interpreting():
        (block_n, block_c), warps = INTERPRETER_CONFIG, 4
    else:
        block_n, block_c, warps = GEMV_CONFIG
    ids, x_div = experts if experts is not None else (w.data, 1)  # (a pointer the kernel never reads)
    rows = out.shape[1] if experts is not None else w.rows
    grid = (triton.cdiv(rows, block_n), out.shape[0])
    _gemv_kernel[grid](x, w.data, _kvalues(w.data.device), out, ids, rows, w.cols // 32, w.data.shape[1],
                       x.stride(0), out.stride(0), x_div, **_consts(w), EXPERTS=experts is not None,
                       BLOCK_N=block_n, BLOCK_C=block_c, num_warps=warps)
    return out


def linear(x: torch.Tensor, w: RawBlocks, out: torch.Tensor) -> torch.Tensor:
    """out [M, rows] = x [M, cols] @ w.T (x rows contiguous; out a view whose rows may be strided)."""
    if x.shape[0] <= GEMV_MAX_M:
        return gemv(x, w, out)
    dense = dequantize(w, torch.empty(w.rows, w.cols, dtype=x.dtype, device=x.device))
    return torch.mm(x, dense.t(), out=out) if out.is_contiguous() else out.copy_(torch.mm(x, dense.t()))
