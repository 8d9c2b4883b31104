"""Prefill over cached context from a cache a kernel cannot read (float8): the pages the step refers to,
dequantized into a compact scratch cache of the model's dtype, with block tables renumbered to match.

Prefill steps with cached context (chunked prefill, prefix-cache hits) are few and compute-bound, so
one gather per layer is cheap beside the attention itself, and any paged kernel (FlashAttention) then
reads the pages as usual. Never used in decode, which reads the cache as stored.
"""
from __future__ import annotations

import dataclasses

import torch

from nanoplug.api import AttentionMetadata, KVLayer


class DequantizedPages:
    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """The step's referenced pages (a row's padding names the scratch page: gathered, never read)."""
        width = -(-meta.max_seqlen_k // block_size)
        tables = meta.block_tables[:, :width]
        self.index = tables.flatten().long()
        pages = torch.arange(self.index.numel(), dtype=torch.int32, device=tables.device).view(tables.shape)
        self.meta = dataclasses.replace(meta, block_tables=pages)

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: KVLayer,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(K pages, V pages) of `dtype` and the metadata whose block tables index them."""
        def pages(cache):  # through an integer view: float8 tensors have no index_select
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[cache.dtype.itemsize]
            return cache.view(bits).index_select(0, self.index).view(cache.dtype)

        k, v = layer.dequantize(pages(k_cache), pages(v_cache), dtype)
        return k, v, self.meta
