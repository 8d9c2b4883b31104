"""Other implementations of the layer library's small ops (a platform's C++ or Triton kernels, torch.compile'd
versions), put into a model's RMSNorm, SiluAndMul, RotaryEmbedding and MoE layers in one walk."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from nanoplug.api.layers.activation import SiluAndMul
from nanoplug.api.layers.moe import FusedMoE, SparseMoeBlock
from nanoplug.api.layers.norm import RMSNorm
from nanoplug.api.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class FusedOps:
    """Same signatures as `rms_norm`, `add_rms_norm`, `silu_and_mul` and `apply_rope`; `norm_rope`, optional,
    is `(positions, q, k, cos, sin, q_weight, k_weight, eps) -> (q, k)`: the q and k norms and the rotation in
    one op (without it the RotaryEmbedding runs the norms then `rope`)."""

    rms_norm: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable
    rope: Callable
    norm_rope: Callable | None = None
    moe: Callable | None = None  # `experts_plain`'s signature: the experts of an MoE layer, one launch per projection
    route: Callable | None = None  # `route`'s signature: an MoE router's softmax, top-k, renormalising, one launch


def install_fused_ops(model: nn.Module, ops: FusedOps) -> int:
    """Route every RMSNorm, SiLU-and-mul, RoPE, MoE experts and router of `model` through `ops`; returns how many
    layers took them."""
    count = 0
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused, m.fused_add = ops.rms_norm, ops.add_rms_norm
        elif isinstance(m, SiluAndMul):
            m.fused = ops.silu_and_mul
        elif isinstance(m, RotaryEmbedding):
            m.fused, m.fused_norm = ops.rope, ops.norm_rope
        elif isinstance(m, FusedMoE) and ops.moe is not None:
            m.fused = ops.moe
        elif isinstance(m, SparseMoeBlock) and ops.route is not None:
            m.fused_route = ops.route
        else:
            continue
        count += 1
    return count
