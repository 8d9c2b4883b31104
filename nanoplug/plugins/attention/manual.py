"""Attention `manual`: plain PyTorch, one sequence at a time, float32 softmax. The oracle.

Every other backend is tested against this one. It reads all keys back from the paged cache, so
chunked prefill, prefix-cache hits and decode take the same, obviously right path; a prefill without
cached context attends over its new K/V as computed, as every backend does (the same values in a cache
of the model's dtype; a float8 or float16 cache's copy would be rounded).
"""
from __future__ import annotations

import torch

from nanoplug.api import AttentionBackend


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks].flatten(0, 1)[:length]


class ManualAttention(AttentionBackend):
    description = "plain PyTorch, float32 softmax (the reference)"
    priority = 0

    def forward(self, q, k, v, k_cache, v_cache, layer):
        meta, spec = self.meta, self.spec
        out = torch.empty_like(q)
        group = spec.num_heads // spec.num_kv_heads
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            qi = q[start:start + q_len].float().transpose(0, 1)  # [H, Lq, D]
            if meta.has_cached_context:
                ki, vi = layer.dequantize(gather_context(k_cache, meta.block_tables[i], seq_len),
                                          gather_context(v_cache, meta.block_tables[i], seq_len), torch.float32)
            else:
                ki, vi = k[start:start + q_len].float(), v[start:start + q_len].float()
            ki = ki.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, D]
            vi = vi.repeat_interleave(group, dim=1).transpose(0, 1)
            scores = (qi @ ki.transpose(1, 2)) * spec.scale
            if spec.softcap is not None:  # Gemma-2's attention logit soft-capping
                scores = torch.tanh(scores / spec.softcap) * spec.softcap
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            masked = k_pos > q_pos
            window = spec.window(layer.index)
            if window is not None:  # a sliding-window layer: keys more than window - 1 back are out of sight
                masked |= k_pos <= q_pos - window
            scores = scores.masked_fill(masked, float("-inf"))
            out[start:start + q_len] = (scores.softmax(dim=-1) @ vi).transpose(0, 1).to(q.dtype)
            start += q_len
        return out
