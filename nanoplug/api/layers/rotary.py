"""Rotary position embedding (the rotate-half form), cos/sin precomputed for every position."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanoplug.api.layers.norm import RMSNorm


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and scaling for the checkpoint's rope type (llama3, yarn, linear, ...)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        factor = getattr(hf_config, "partial_rotary_factor", 1.0)
        dim = int(head_dim * factor)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def apply_rope(positions, q, k, cos_table, sin_table):
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(dtype)


class RotaryEmbedding(nn.Module):
    """`forward(positions, q, k) -> (q, k)` rotated; tables cover `max_positions` positions. Given the q and k
    norms (Qwen3's RMSNorm over each head), q and k are normalized first: through one fused op where one is
    installed (normalizing and rotating every head of a token in one pass), else the norms then the rotation."""

    fused = None  # set by install_fused_ops: FusedOps.rope
    fused_norm = None  # and FusedOps.norm_rope, when the ops have one

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None):
        if q_norm is not None or k_norm is not None:
            if self.fused_norm is not None and q_norm is not None and k_norm is not None and q_norm.eps == k_norm.eps:
                return self.fused_norm(positions, q, k, self.cos, self.sin, q_norm.weight, k_norm.weight, q_norm.eps)
            q = q if q_norm is None else q_norm(q)
            k = k if k_norm is None else k_norm(k)
        return (self.fused or apply_rope)(positions, q, k, self.cos, self.sin)
