"""Attention `chunked`: exact attention over the paged KV cache, one chunk of cache blocks at a time.

Scores for a whole context never exist at once: each chunk updates a running max, a running sum and
an output accumulator in float32 (the online softmax of flash attention), so memory per sequence is
bounded by the chunk, not by the context length. Plain PyTorch, one sequence at a time: a readable
example of a third-party backend, not a fast one.
"""
from __future__ import annotations

import torch

from nanoplug.api import AttentionBackend, Target, hookimpl

NANOPLUG_API_VERSION = 3  # the plugin API this module was written for; the registry refuses others

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCKS_PER_CHUNK = 2


class ChunkedAttention(AttentionBackend):
    description = "online-softmax attention over chunks of KV blocks (example third-party plugin)"
    priority = -10  # never chosen by "auto" over the built-ins; ask for it by name

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = []
        if target.device.type not in ("cpu", "cuda"):
            reasons.append(f"runs on cpu and cuda only (device is {target.device.type})")
        if target.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {target.dtype} unsupported; use float32, float16 or bfloat16")
        return reasons

    def forward(self, q, k, v, k_cache, v_cache, layer):
        meta, spec = self.meta, self.spec
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            qi = q[start:start + q_len].float().transpose(0, 1) * spec.scale  # [H, Lq, D]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            out[start:start + q_len] = self._attend(qi, q_pos, k_cache, v_cache, meta.block_tables[i], seq_len)
            start += q_len
        return out

    def _attend(self, qi, q_pos, k_cache, v_cache, block_table, seq_len):
        """Online softmax over the context's blocks, BLOCKS_PER_CHUNK at a time: [Lq, H, D] in q's dtype."""
        spec = self.spec
        group = spec.num_heads // spec.num_kv_heads
        heads, q_len, _ = qi.shape
        running_max = qi.new_full((heads, q_len, 1), float("-inf"))
        running_sum = qi.new_zeros((heads, q_len, 1))
        acc = torch.zeros_like(qi)
        chunk = BLOCKS_PER_CHUNK * spec.block_size
        for first in range(0, seq_len, chunk):
            last = min(first + chunk, seq_len)
            blocks = block_table[first // spec.block_size:(last + spec.block_size - 1) // spec.block_size].long()
            kc = k_cache[blocks].flatten(0, 1)[: last - first].float().repeat_interleave(group, dim=1).transpose(0, 1)
            vc = v_cache[blocks].flatten(0, 1)[: last - first].float().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qi @ kc.transpose(1, 2)  # [H, Lq, C]
            k_pos = torch.arange(first, last, device=qi.device).unsqueeze(0)
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
            safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)  # rows masked so far
            weights = torch.exp(scores - safe_max)
            rescale = torch.exp(running_max - safe_max)
            running_sum = running_sum * rescale + weights.sum(dim=-1, keepdim=True)
            acc = acc * rescale + weights @ vc
            running_max = new_max
        return (acc / running_sum).transpose(0, 1).to(self.spec.dtype)


@hookimpl
def nanoplug_register_attention(register) -> None:
    register.add("chunked", ChunkedAttention)
