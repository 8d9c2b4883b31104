"""int4 weights in one layout for every checkpoint format: `qweight` int32 [N, K/8] (eight unsigned 4-bit
values per word along K, value k at bits 4*(k % 8): compressed-tensors' pack-quantized order), `scales`
[N, K/group] and `zeros` uint8 [N, K/group] (None: symmetric, zero point 8). w = (q - zero) * scale.

GPTQ and AWQ checkpoints are repacked into it on load (`from_gptq`, `from_awq`); an activation-order
checkpoint's columns are sorted by group on load (`sort_by_group`) so every kernel reads contiguous groups,
and its inputs are gathered by the same permutation on each call.
"""
from __future__ import annotations

import torch

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # value i of a word at bits 4*i
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i holds column AWQ_ORDER[i] of its eight


def unpack_int4(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """uint8 values 0..15 of int32 words, eight per word along `dim` (value i at bits 4*i)."""
    packed = packed.movedim(dim, -1)
    values = (packed.unsqueeze(-1) >> SHIFTS.to(packed.device)) & 0xF
    return values.reshape(*packed.shape[:-1], -1).to(torch.uint8).movedim(-1, dim)


def pack_int4(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The inverse of unpack_int4: values 0..15 packed eight per int32 word along `dim`."""
    values = values.movedim(dim, -1).to(torch.int32)
    words = values.reshape(*values.shape[:-1], -1, 8) << SHIFTS.to(values.device)
    return words.sum(-1, dtype=torch.int32).movedim(-1, dim).contiguous()


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The float weight [N, K]; `g_idx` [K]: each column's group (default: column // group size)."""
    q = unpack_int4(qweight).to(torch.float32)
    n, k = q.shape
    if g_idx is None:
        g_idx = torch.arange(k, device=q.device) // (k // scales.shape[1])
    zero = 8.0 if zeros is None else zeros.to(torch.float32)[:, g_idx]
    return ((q - zero) * scales.to(torch.float32)[:, g_idx]).to(dtype)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              zero_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's qweight int32 [K/8, N] (packed along K), qzeros int32 [G, N/8] (packed along N), scales [G, N]
    as this layout's (qweight, scales, zeros). `zero_offset`: 1 for GPTQ's v1 checkpoints, whose zeros are
    stored less one (AutoGPTQ, GPTQModel's default export), 0 for v2."""
    q = unpack_int4(qweight, dim=0).t()  # [N, K]
    zeros = (unpack_int4(qzeros, dim=1).to(torch.int16) + zero_offset).clamp(0, 15).to(torch.uint8).t()
    return pack_int4(q), scales.t().contiguous(), zeros.contiguous()


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's (GEMM version) qweight int32 [K, N/8] and qzeros int32 [G, N/8], both packed along N in AWQ's
    interleaved order, scales [G, N] as this layout's (qweight, scales, zeros)."""
    order = torch.tensor([AWQ_ORDER.index(i) for i in range(8)], device=qweight.device)

    def unpack_awq(t: torch.Tensor) -> torch.Tensor:
        v = unpack_int4(t, dim=1)
        return v.reshape(v.shape[0], -1, 8)[:, :, order].reshape(v.shape[0], -1)

    return pack_int4(unpack_awq(qweight).t()), scales.t().contiguous(), unpack_awq(qzeros).t().contiguous()


def sort_by_group(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The column permutation that makes an activation-order checkpoint's groups contiguous (None: they are);
    a g_idx without `group_size` columns in each group is a ValueError."""
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group_size):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(k, device=g_idx.device) // group_size):
        raise ValueError(f"its g_idx does not put {group_size} columns in each group")
    return perm
