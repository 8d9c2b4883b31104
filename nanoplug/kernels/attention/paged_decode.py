"""Decode steps (one new query per sequence) of the `sdpa` backend, shaped for the CPU.

The padded path gathers whole blocks of K/V per layer with advanced indexing, repeats K/V for
grouped-query attention and masks a square of padding. A decode step needs much less: gather just
the `max_seqlen_k` live tokens of each sequence with one `index_select` (index built once per step),
and let the query heads that share a KV head ride along as the query rows of that KV head, so
neither K nor V is ever repeated. The additive padding mask is built once per step too.
"""
from __future__ import annotations

import torch

from nanoplug.api import AttentionMetadata, AttentionSpec, KVLayer
from nanoplug.kernels.attention import softcap


class PagedDecode:
    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.group = spec.num_heads // spec.num_kv_heads
        self.cast = spec.cache_dtype != spec.dtype  # a cache of another dtype is read as the model's

    @staticmethod
    def serves(meta: AttentionMetadata) -> bool:
        """Every sequence adds exactly one token at the end of its context."""
        return meta.max_seqlen_q == 1

    def prepare(self, meta: AttentionMetadata) -> None:
        bs, dev = self.spec.block_size, meta.slot_mapping.device
        max_k = meta.max_seqlen_k
        pos = torch.arange(max_k, device=dev)
        tables = meta.block_tables[:, : (max_k + bs - 1) // bs].long()
        self.index = (tables[:, pos // bs] * bs + pos % bs).flatten()  # cache slot of every (seq, position)
        seq_lens = meta.seq_lens.long().unsqueeze(1)
        pad = pos.unsqueeze(0) >= seq_lens  # [B, Lk]
        self.masks = {}  # one per sliding window of the model's layers (None: full attention)
        for w in self.spec.windows:
            hidden = pad if w is None else pad | (pos.unsqueeze(0) <= seq_lens - 1 - w)
            mask = torch.zeros(pad.shape, dtype=self.spec.dtype, device=dev).masked_fill_(hidden, float("-inf"))
            self.masks[w] = mask.view(pad.shape[0], 1, 1, max_k)
        self.max_k = max_k

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: KVLayer) -> torch.Tensor:
        """q: [B, H, D] (one row per sequence) -> [B, H, D]."""
        num_seqs, kv_heads, dim = q.shape[0], self.spec.num_kv_heads, q.shape[2]
        shape = (num_seqs, self.max_k, kv_heads, dim)
        if self.cast:  # through an integer view: float8 tensors have no index_select
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[k_cache.dtype.itemsize]
            k_cache, v_cache = k_cache.view(bits), v_cache.view(bits)
        keys = k_cache.view(-1, kv_heads, dim).index_select(0, self.index).view(shape).transpose(1, 2)
        values = v_cache.view(-1, kv_heads, dim).index_select(0, self.index).view(shape).transpose(1, 2)
        if self.cast:
            keys, values = keys.view(self.spec.cache_dtype), values.view(self.spec.cache_dtype)
        if self.cast:
            keys, values = layer.dequantize(keys, values, q.dtype)
        queries = q.reshape(num_seqs, kv_heads, self.group, dim)  # heads of one KV head as its query rows
        out = softcap.attention(queries, keys, values, self.masks[self.spec.window(layer.index)], self.spec.scale,
                                self.spec.softcap)
        return out.reshape(num_seqs, self.spec.num_heads, dim)
