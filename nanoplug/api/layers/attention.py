"""The attention module every model layer uses: store new K/V through the KV-cache store, then attend
through the attention backend. Both are resolved once per engine and reached through `StepContext`,
which each worker owns (no global), so two engines in one process never share a step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nanoplug.api.interfaces import AttentionBackend, KVCacheStore
from nanoplug.api.step import AttentionMetadata, KVLayer


@dataclass
class StepContext:
    """What the layers of one engine share: its plugins, its KV cache and the current step's layout."""

    store: KVCacheStore
    prefill: AttentionBackend
    decode: AttentionBackend
    kv: list[tuple[torch.Tensor, torch.Tensor, KVLayer]] = field(default_factory=list)  # per layer: K, V, layer
    meta: AttentionMetadata | None = None

    def set_step(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        (self.prefill if meta.is_prefill else self.decode).prepare(meta)


class PagedAttention(nn.Module):
    def __init__(self, ctx: StepContext, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.ctx, self.layer_idx = ctx, layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, Hkv, D] -> [N, H, D]."""
        ctx = self.ctx
        k_cache, v_cache, layer = ctx.kv[self.layer_idx]
        meta = ctx.meta
        backend = ctx.prefill if meta.is_prefill else ctx.decode
        return ctx.store.attend(backend, q, k, v, k_cache, v_cache, meta.slot_mapping, layer)
