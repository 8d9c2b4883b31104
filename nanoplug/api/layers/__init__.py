"""The layer library every model builds from: linear and parallel linear layers, embedding and LM head
(each holding its weight through a LinearMethod), RMSNorm, rotary embedding, SiLU-and-mul, and
`PagedAttention`. Model plugins get a `Layers` factory bound to the process group and the linear
method, so parallel strategies and weight formats swap without touching a model."""
from __future__ import annotations

from typing import Any

from nanoplug.api.layers.activation import SiluAndMul, silu_and_mul
from nanoplug.api.layers.attention import PagedAttention, StepContext
from nanoplug.api.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoplug.api.layers.fused import FusedOps, install_fused_ops
from nanoplug.api.layers.moe import (FusedMoE, SparseMoeBlock, StackedExperts, experts_batched, experts_plain,
                                     experts_stacked, route)
from nanoplug.api.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                        QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
from nanoplug.api.layers.norm import RMSNorm, add_rms_norm, residual_stream, rms_norm
from nanoplug.api.layers.rotary import RotaryEmbedding, apply_rope, rope_inv_freq
from nanoplug.api.linear import DenseLinearMethod, LinearMethod

__all__ = [
    "Layers", "LinearBase", "ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear",
    "QKVParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "RMSNorm", "rms_norm",
    "add_rms_norm", "residual_stream", "RotaryEmbedding", "apply_rope", "rope_inv_freq", "SiluAndMul", "silu_and_mul",
    "FusedOps", "install_fused_ops", "PagedAttention", "StepContext", "FusedMoE", "SparseMoeBlock", "route", "experts_plain",
    "experts_batched", "experts_stacked", "StackedExperts",
]


class Layers:
    """The layer factory a model plugin receives: every layer bound to one process group and one linear method."""

    def __init__(self, group: Any, linear_method: LinearMethod | None = None):
        self.group = group
        self.linear_method = linear_method or DenseLinearMethod()

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def replicated(self, in_features, out_features, bias=False):
        return ReplicatedLinear(self.group, in_features, out_features, bias, self.linear_method)

    def column(self, in_features, out_features, bias=False):
        return ColumnParallelLinear(self.group, in_features, out_features, bias, self.linear_method)

    def merged_column(self, in_features, output_sizes, bias=False):
        return MergedColumnParallelLinear(self.group, in_features, output_sizes, bias, self.linear_method)

    def qkv(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False):
        return QKVParallelLinear(self.group, hidden_size, head_dim, num_heads, num_kv_heads, bias, self.linear_method)

    def row(self, in_features, out_features, bias=False):
        return RowParallelLinear(self.group, in_features, out_features, bias, self.linear_method)

    def embedding(self, vocab_size, hidden_size):
        return VocabParallelEmbedding(self.group, vocab_size, hidden_size, self.linear_method)

    def lm_head(self, vocab_size, hidden_size):
        return ParallelLMHead(self.group, vocab_size, hidden_size, self.linear_method)

    def experts(self, num_experts, hidden_size, intermediate_size):
        return FusedMoE(self.group, num_experts, hidden_size, intermediate_size, self.linear_method)
