"""Attention with logit soft-capping (Gemma-2: each score s, scale applied, becomes tanh(s / cap) * cap before
the softmax) for the paths that would call `scaled_dot_product_attention`, which has no soft-capping: the same
arguments, computed as matmul, tanh, mask, softmax (float32), matmul. With no cap it is sdpa itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, scale: float,
              softcap: float | None, enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale, enable_gqa=...)` ([..., H, Lq, D] and
    [..., Hkv, Lk, D]; a boolean mask keeps True, a float mask is added), with the scores soft-capped."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)
