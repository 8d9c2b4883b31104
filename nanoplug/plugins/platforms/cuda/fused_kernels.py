"""The small ops of every layer (RMSNorm with and without the residual add, SiLU-and-mul, RoPE) as one
Triton kernel each, with the layer library's exact float32 math and roundings (nanoplug.api.layers).

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
                         stride_res, eps, N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
        """Row r of x (at (r // rows_per_outer) * stride_outer + (r % rows_per_outer) * stride_inner), plus the
        residual's row when ADD (that sum, rounded to x's dtype, is written out too), normalized in float32,
        rounded, then times the weight and rounded again: rms_norm's order of roundings."""
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x_off = (r // rows_per_outer).to(tl.int64) * stride_outer + (r % rows_per_outer) * stride_inner
        x = tl.load(x_ptr + x_off + cols, mask=ok, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(res_ptr + r.to(tl.int64) * stride_res + cols, mask=ok, other=0.0)
                 .to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + r.to(tl.int64) * N + cols, x, mask=ok)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = (xf * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r.to(tl.int64) * N + cols, (w * y).to(x.dtype), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr):
        """out[r] = silu(gate) * up, silu rounded to the dtype first (as F.silu then * does)."""
        r = tl.program_id(0).to(tl.int64)
        for start in tl.static_range(0, D, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < D
            gate = tl.load(x_ptr + r * stride_x + cols, mask=ok, other=0.0)
            up = tl.load(x_ptr + r * stride_x + D + cols, mask=ok, other=0.0).to(tl.float32)
            g = gate.to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
            tl.store(out_ptr + r * D + cols, (silu * up).to(gate.dtype), mask=ok)

    @triton.jit
    def _rope_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, heads, stride_t, stride_h,
                     HALF: tl.constexpr, BLOCK: tl.constexpr):
        """Head h of token t rotated (rotate-half form) in float32 by its position's cos/sin rows."""
        r = tl.program_id(0)
        t = (r // heads).to(tl.int64)
        h = r % heads
        cols = tl.arange(0, BLOCK)
        ok = cols < HALF
        base = x_ptr + t * stride_t + h * stride_h
        x1 = tl.load(base + cols, mask=ok, other=0.0)
        x2 = tl.load(base + HALF + cols, mask=ok, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        row = pos * (2 * HALF)
        cos1 = tl.load(cos_ptr + row + cols, mask=ok, other=0.0)
        cos2 = tl.load(cos_ptr + row + HALF + cols, mask=ok, other=0.0)
        sin1 = tl.load(sin_ptr + row + cols, mask=ok, other=0.0)
        sin2 = tl.load(sin_ptr + row + HALF + cols, mask=ok, other=0.0)
        x1f = x1.to(tl.float32)
        out = out_ptr + r.to(tl.int64) * (2 * HALF)
        tl.store(out + cols, (x1f * cos1 - x2 * sin1).to(x1.dtype), mask=ok)
        tl.store(out + HALF + cols, (x2 * cos2 + x1f * sin2).to(x1.dtype), mask=ok)


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
    layout = _rows(x)
    if weight.dtype != x.dtype or layout is None:
        return plain_rms_norm(x, weight, eps)
    rows, per_outer, outer, inner = layout
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, x, weight, out, out, per_outer, outer, inner, 0, eps, N=x.shape[-1],
                                  BLOCK=triton.next_power_of_2(x.shape[-1]), ADD=False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    if (weight.dtype != x.dtype or residual.dtype != x.dtype or x.dim() != 2 or residual.shape != x.shape
            or x.stride(-1) != 1 or residual.stride(-1) != 1):
        return plain_add_rms_norm(x, residual, weight, eps)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, summed, 1, x.stride(0), 0, residual.stride(0), eps,
                                        N=n, BLOCK=triton.next_power_of_2(n), ADD=True)
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        return plain_silu_and_mul(x)
    d = x.shape[-1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0],)](x, out, x.stride(0), D=d, BLOCK=min(triton.next_power_of_2(d), 2048))
    return out


def _rope_one(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, heads, dim = x.shape
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t * heads,)](x, out, positions, cos, sin, heads, x.stride(0), x.stride(1), HALF=dim // 2,
                                   BLOCK=triton.next_power_of_2(dim // 2))
    return out


def apply_rope(positions, q, k, cos_table, sin_table):
    if (q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1 or positions.dim() != 1
            or cos_table.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1] or not cos_table.is_contiguous()
            or not sin_table.is_contiguous()):
        return plain_apply_rope(positions, q, k, cos_table, sin_table)
    return _rope_one(q, positions, cos_table, sin_table), _rope_one(k, positions, cos_table, sin_table)


def fused_ops() -> FusedOps | None:
    """The four ops as Triton kernels, or None where triton does not import."""
    if triton is None:
        return None
    return FusedOps(rms_norm, add_rms_norm, silu_and_mul, apply_rope)
