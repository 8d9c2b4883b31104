"""Attention `flash`: FlashAttention kernels reading the paged KV cache directly.

Two builds can serve, tried in this order: the `flash_attn` package (FlashAttention-2:
`flash_attn_varlen_func` with `block_table`, `flash_attn_with_kvcache` for decode), and
FlashAttention-4 (`flash_attn.cute`, package `flash-attn-4`: one `flash_attn_varlen_func` with
`page_table` + `seqused_k` for paged prefill, and the same function on a batch of one-token
queries for decode). Prefill without cached context attends
over the new K/V themselves (no page indirection); chunked prefill, prefix-cache hits and decode
read keys through the block tables. Causal masks align to the bottom right, which is exactly "new
queries at the end of their context". No host sync, so decode runs inside CUDA graphs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nanoplug.api import AttentionBackend, AttentionMetadata, Target
INSTALL_HINT = "pip install flash-attn (FlashAttention-2, Ampere or newer) or pip install flash-attn-4 (Hopper/Blackwell)"


@dataclass(frozen=True)
class FlashKernels:
    """One FlashAttention build: its name, the GPUs it runs on, and its entry points."""

    name: str
    min_capability: tuple[int, int]
    max_capability: tuple[int, int]
    varlen: Callable[..., Any]
    with_kvcache: Callable[..., Any] | None
    block_multiple: int  # the paged cache's block size must be a multiple of this


@functools.lru_cache(maxsize=None)
def load_kernels() -> tuple[FlashKernels | None, list[str]]:
    """The first FlashAttention build that imports, or None and why each did not."""
    errors = []
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # FlashAttention-2
    except Exception as exc:
        errors.append(f"flash_attn (FA2): {type(exc).__name__}: {exc}")
    else:
        return FlashKernels("FA2", (8, 0), (12, 9), flash_attn_varlen_func, flash_attn_with_kvcache, 256), errors
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func  # FlashAttention-4
    except Exception as exc:
        errors.append(f"flash_attn.cute (FA4): {type(exc).__name__}: {exc}")
    else:
        return FlashKernels("FA4", (9, 0), (11, 9), flash_attn_varlen_func, None, 1), errors
    return None, errors


class FlashAttention(AttentionBackend):
    description = "FlashAttention-2 (flash-attn) or FlashAttention-4 (flash-attn-4), paged, CUDA graphs"
    priority = 100
    supports_cuda_graphs = True

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = []
        if target.device.type != "cuda":
            return [f"needs CUDA (device is {target.device.type}); use attention='cpu', 'sdpa' or 'manual' on CPU"]
        if target.dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"needs dtype float16 or bfloat16 (got {str(target.dtype).removeprefix('torch.')}); "
                           "pass dtype='bfloat16'")
        model = target.model
        if model is not None and (model.head_dim % 8 or model.head_dim > 256):
            reasons.append(f"head size {model.head_dim} unsupported (needs a multiple of 8, at most 256)")
        kernels, errors = load_kernels()
        if kernels is None:
            return reasons + [f"no FlashAttention build imports ({'; '.join(errors)}); {INSTALL_HINT}"]
        cap = torch.cuda.get_device_capability(target.device)
        if not kernels.min_capability <= cap <= kernels.max_capability:
            reasons.append(f"{kernels.name} needs compute capability {kernels.min_capability[0]}.{kernels.min_capability[1]}"
                           f" to {kernels.max_capability[0]}.x, this GPU has {cap[0]}.{cap[1]}; {INSTALL_HINT}")
        if target.cache_dtype != target.dtype:
            reasons.append(f"reads a cache of the model's dtype only, not {str(target.cache_dtype).removeprefix('torch.')}; "
                           "use kv_cache='torch' or 'triton'")
        block = target.block_size
        if block % kernels.block_multiple:
            reasons.append(f"{kernels.name} paged attention needs kv_block_size a multiple of "
                           f"{kernels.block_multiple} (got {block})")
        return reasons

    def __init__(self, spec):
        super().__init__(spec)
        self.kernels, _ = load_kernels()

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta  # padding in the block tables names the scratch block: every entry is a real page
        self.paged = not meta.is_prefill or meta.has_cached_context

    def forward(self, q, k, v, k_cache, v_cache, layer):
        meta, scale = self.meta, self.spec.scale
        if self.kernels.name == "FA2":
            return self._fa2(q, k, v, k_cache, v_cache, meta, scale)
        if not self.paged:
            out = self.kernels.varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_q,
                                      max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_q,
                                      softmax_scale=scale, causal=True)
        elif not meta.is_prefill:
            # decode as a batch of one-token queries [B, 1, H, D], not varlen: no per-call tile
            # scheduling, 25% faster on the H200 (benchmarks/gpu_decode_attention.py)
            out = self.kernels.varlen(q.unsqueeze(1), k_cache, v_cache, seqused_k=meta.seq_lens,
                                      page_table=meta.block_tables, softmax_scale=scale, causal=True)
            out = out[0] if isinstance(out, tuple) else out
            return out.squeeze(1)
        else:
            out = self.kernels.varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seq_lens,
                                      max_seqlen_q=meta.max_seqlen_q, page_table=meta.block_tables,
                                      softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def _fa2(self, q, k, v, k_cache, v_cache, meta, scale):
        if meta.is_prefill and not meta.has_cached_context:
            return self.kernels.varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q,
                                       meta.max_seqlen_q, softmax_scale=scale, causal=True)
        if meta.is_prefill:
            return self.kernels.varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                       meta.max_seqlen_k, softmax_scale=scale, causal=True,
                                       block_table=meta.block_tables)
        out = self.kernels.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                        block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)
