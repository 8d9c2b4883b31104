"""The small ops of every layer (RMSNorm with and without the residual add, SiLU-and-mul, RoPE on q and k,
and Qwen3's q and k norms with the RoPE after them) as one Triton kernel each, with the layer library's exact
float32 math and roundings (nanoplug.api.layers).

On a GPU each eager op is several launches and passes over memory; one kernel each is what torch.compile
would make of them too, but a compiled region costs its guards and wrappers on every call (a prefill step
that is not captured pays that a few hundred times) and Dynamo's tracing and Inductor's import at every
start-up. These are plain launches, compiled once per machine by Triton's own cache.
On a CPU they run only under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch

from nanoplug.api import FusedOps, import_triton
from nanoplug.api import add_rms_norm as plain_add_rms_norm
from nanoplug.api import apply_rope as plain_apply_rope
from nanoplug.api import rms_norm as plain_rms_norm
from nanoplug.api import silu_and_mul as plain_silu_and_mul

# where triton is missing or broken (TRITON_ERROR says why): the platform keeps torch.compile'd ops
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows_per_outer, stride_outer, stride_inner,
                         stride_res, eps, N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
                         WIDE: tl.constexpr):
        """Row r of x (at (r // rows_per_outer) * stride_outer + (r % rows_per_outer) * stride_inner), plus the
        residual's row when ADD (that sum, rounded to x's dtype, is written out too), normalized in float32,
        rounded, then times the weight and rounded again: rms_norm's order of roundings. WIDE (a 16-bit model's
        float32 residual stream: x float32 without ADD, or a 16-bit x with a float32 residual): the sum is kept
        and written in float32, and its norm times the weight rounded once, to out's dtype, as the plain ops do."""
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x_off = (r // rows_per_outer).to(tl.int64) * stride_outer + (r % rows_per_outer) * stride_inner
        x = tl.load(x_ptr + x_off + cols, mask=ok, other=0.0)
        if ADD:
            summed = x.to(tl.float32) + tl.load(res_ptr + r.to(tl.int64) * stride_res + cols, mask=ok,
                                                other=0.0).to(tl.float32)
            if WIDE:
                tl.store(res_out_ptr + r.to(tl.int64) * N + cols, summed, mask=ok)
                xf = summed
            else:
                x = summed.to(x.dtype)
                tl.store(res_out_ptr + r.to(tl.int64) * N + cols, x, mask=ok)
                xf = x.to(tl.float32)
        else:
            xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if WIDE:
            tl.store(out_ptr + r.to(tl.int64) * N + cols, ((xf * inv) * w).to(out_ptr.dtype.element_ty), mask=ok)
        else:
            y = (xf * inv).to(x.dtype).to(tl.float32)
            tl.store(out_ptr + r.to(tl.int64) * N + cols, (w * y).to(x.dtype), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr):
        """out[r] = silu(gate) * up, silu rounded to the dtype first (as F.silu then * does); one program a
        row's BLOCK columns, so a single row (batch-1 decode) spreads over many SMs."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < D
        gate = tl.load(x_ptr + r * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + r * stride_x + D + cols, mask=ok, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + r * D + cols, (silu * up).to(gate.dtype), mask=ok)

    @triton.jit
    def _norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cos_ptr, sin_ptr, q_heads,
                          k_heads, stride_qt, stride_qh, stride_kt, stride_kh, eps, HALF: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):
        """BLOCK_H head rows of token t (its q heads, then its k heads), each loaded as its two halves (the
        rotate-half pairs): when NORM, normalized with rms_norm's roundings (q's weight or k's); then rotated in
        float32 by the position's cos/sin rows and rounded once, as apply_rope does. One launch for what were
        two norms and two rotations."""
        t = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_D)
        col_ok = (cols < HALF)[None, :]
        is_q = (rows < q_heads)[:, None]
        q_ok = is_q & col_ok
        k_ok = (rows >= q_heads)[:, None] & (rows < q_heads + k_heads)[:, None] & col_ok
        q_at = t * stride_qt + rows[:, None] * stride_qh + cols[None, :]
        k_at = t * stride_kt + (rows - q_heads)[:, None] * stride_kh + cols[None, :]
        x1 = tl.where(is_q, tl.load(q_ptr + q_at, mask=q_ok, other=0.0), tl.load(k_ptr + k_at, mask=k_ok, other=0.0))
        x2 = tl.where(is_q, tl.load(q_ptr + q_at + HALF, mask=q_ok, other=0.0),
                      tl.load(k_ptr + k_at + HALF, mask=k_ok, other=0.0))
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        if NORM:
            inv = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF) + eps)[:, None]
            w1 = tl.where(is_q, tl.load(qw_ptr + cols, mask=cols < HALF, other=0.0)[None, :],
                          tl.load(kw_ptr + cols, mask=cols < HALF, other=0.0)[None, :]).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qw_ptr + HALF + cols, mask=cols < HALF, other=0.0)[None, :],
                          tl.load(kw_ptr + HALF + cols, mask=cols < HALF, other=0.0)[None, :]).to(tl.float32)
            x1f = (w1 * (x1f * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
            x2f = (w2 * (x2f * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        row = tl.load(pos_ptr + t) * (2 * HALF)
        cos1 = tl.load(cos_ptr + row + cols, mask=cols < HALF, other=0.0)[None, :]
        cos2 = tl.load(cos_ptr + row + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
        sin1 = tl.load(sin_ptr + row + cols, mask=cols < HALF, other=0.0)[None, :]
        sin2 = tl.load(sin_ptr + row + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
        y1 = (x1f * cos1 - x2f * sin1).to(x1.dtype)
        y2 = (x2f * cos2 + x1f * sin2).to(x1.dtype)
        q_out = q_out_ptr + (t * q_heads + rows[:, None]) * (2 * HALF) + cols[None, :]
        k_out = k_out_ptr + (t * k_heads + (rows - q_heads)[:, None]) * (2 * HALF) + cols[None, :]
        tl.store(q_out, y1, mask=q_ok)
        tl.store(q_out + HALF, y2, mask=q_ok)
        tl.store(k_out, y1, mask=k_ok)
        tl.store(k_out + HALF, y2, mask=k_ok)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(rows, rows per outer index, outer stride, inner stride) of x's rows along its last dim: 2-D [T, N] or
    3-D [T, H, N] (a view of a wider projection, as q and k are) with a contiguous last dim; else None."""
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        return None
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


# Each op takes the layouts the layer library's decoders give it; any other (a weight of another dtype, whose
# plain result takes the wider dtype; other ranks; partial rotary tables) goes to the plain op.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The layer library's rms_norm: x of the weight's dtype, or float32 (a 16-bit model's residual stream)."""
    layout = _rows(x)
    wide = x.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16)
    if not (wide or weight.dtype == x.dtype) or layout is None:
        return plain_rms_norm(x, weight, eps)
    rows, per_outer, outer, inner = layout
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, x, weight, out, out, per_outer, outer, inner, 0, eps, N=x.shape[-1],
                                  BLOCK=triton.next_power_of_2(x.shape[-1]), ADD=False, WIDE=wide)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The layer library's add_rms_norm: residual of x's dtype, or float32 (a 16-bit model's residual stream)."""
    wide = residual.dtype == torch.float32 and x.dtype != torch.float32
    if (weight.dtype != x.dtype or not (wide or residual.dtype == x.dtype) or x.dim() != 2
            or residual.shape != x.shape or x.stride(-1) != 1 or residual.stride(-1) != 1):
        return plain_add_rms_norm(x, residual, weight, eps)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, summed, 1, x.stride(0), 0, residual.stride(0), eps,
                                        N=n, BLOCK=triton.next_power_of_2(n), ADD=True, WIDE=wide)
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        return plain_silu_and_mul(x)
    d = x.shape[-1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](x, out, x.stride(0), D=d, BLOCK=block)
    return out


def _norm_rope_takes(positions, q, k, cos_table, sin_table, q_weight, k_weight) -> bool:
    """Whether the kernel takes these: [T, H, D] q and k of one float dtype with contiguous rows, D even and at
    most 512, full float32 tables, and weights (when given) of q's dtype and size D."""
    dim = q.shape[-1] if q.dim() == 3 else 0
    if (q.dim() != 3 or k.dim() != 3 or dim % 2 or not 0 < dim <= 512 or k.shape[::2] != q.shape[::2]
            or q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or q.stride(-1) != 1 or k.stride(-1) != 1 or positions.dim() != 1 or positions.shape[0] != q.shape[0]
            or positions.dtype not in (torch.int64, torch.int32)):
        return False
    for table in (cos_table, sin_table):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[-1] != dim or not table.is_contiguous():
            return False
    return q_weight is None or all(w.dtype == q.dtype and w.shape == (dim,) and w.is_contiguous()
                                   for w in (q_weight, k_weight))


def norm_rope(positions, q, k, cos_table, sin_table, q_weight=None, k_weight=None, eps=0.0):
    """`apply_rope(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), ...)` in one launch; with
    no weights, RoPE alone (q and k in one launch)."""
    if not _norm_rope_takes(positions, q, k, cos_table, sin_table, q_weight, k_weight):
        if q_weight is not None:
            q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        return plain_apply_rope(positions, q, k, cos_table, sin_table)
    t, q_heads, dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty((t, q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, k_heads, dim), dtype=k.dtype, device=k.device)
    if t and q_heads + k_heads:
        # a program takes a block of head rows (about a thousand elements; of all heads in one block, a large
        # batch's programs ran slower, and at batch 1 one program did the whole step's work in sequence), the
        # same block at every batch size, so a token's result does not depend on the batch it is in;
        # fp fusion off: an FMA in the rotation would round differently from the plain op's multiply then add
        block_d = triton.next_power_of_2(dim // 2)
        block_h = max(1, 512 // block_d)
        norm = q_weight is not None
        _norm_rope_kernel[(t, triton.cdiv(q_heads + k_heads, block_h))](
            q, k, q_out, k_out, q_weight if norm else q, k_weight if norm else k, positions, cos_table, sin_table,
            q_heads, k_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps, HALF=dim // 2,
            BLOCK_D=block_d, BLOCK_H=block_h, NORM=norm, num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


def apply_rope(positions, q, k, cos_table, sin_table):
    return norm_rope(positions, q, k, cos_table, sin_table)


def fused_ops() -> FusedOps | None:
    """The ops as Triton kernels, or None where triton does not import."""
    if triton is None:
        return None
    return FusedOps(rms_norm, add_rms_norm, silu_and_mul, apply_rope, norm_rope=norm_rope)
