"""The CUDA fast path of attention `sdpa`: PyTorch's own varlen FlashAttention kernel.

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) runs packed variable-length sequences with
no padding. Prefill without cached context always takes it; paged steps (decode, chunked prefill,
prefix hits) take it only where this torch accepts `block_table` + `seqused_k`, and otherwise fall
back to the padded path of `sdpa.py`. Keyword names moved between torch releases, so the call is
shaped once from the function's signature.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from nanoplug.api import AttentionMetadata, AttentionSpec


@functools.lru_cache(maxsize=None)
def _varlen() -> tuple[Callable[..., Any] | None, frozenset[str]]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class CudaVarlenAttention:
    """Packed-sequence attention for `SdpaAttention` on CUDA in float16/bfloat16."""

    @staticmethod
    def usable(spec: AttentionSpec) -> bool:
        fn, _ = _varlen()
        return (fn is not None and spec.device.type == "cuda" and spec.dtype in (torch.float16, torch.bfloat16)
                and spec.cache_dtype == spec.dtype)

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.fn, params = _varlen()
        self.gqa = spec.num_heads != spec.num_kv_heads
        self.kwargs: dict[str, Any] = {"scale": spec.scale}
        if "window_size" in params:
            self.kwargs["window_size"] = (-1, 0)  # causal, aligned to the bottom right
        else:
            self.kwargs["is_causal"] = True
        self.native_gqa = "enable_gqa" in params
        # paged only where torch takes pages and grouped heads natively (repeating a whole cache is no path)
        self.can_page = {"block_table", "seqused_k"} <= params and (not self.gqa or self.native_gqa)
        if self.gqa and self.native_gqa:
            self.kwargs["enable_gqa"] = True

    def serves(self, meta: AttentionMetadata) -> bool:
        return (meta.is_prefill and not meta.has_cached_context) or self.can_page

    def _heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if not self.gqa or self.native_gqa:
            return x
        return x.repeat_interleave(self.spec.num_heads // self.spec.num_kv_heads, dim=dim)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_prefill and not meta.has_cached_context:
            out = self.fn(q, self._heads(k, 1), self._heads(v, 1), meta.cu_seqlens_q, meta.cu_seqlens_q,
                          meta.max_seqlen_q, meta.max_seqlen_q, **self.kwargs)
        else:
            out = self.fn(q, k_cache, v_cache, meta.cu_seqlens_q, None,
                          meta.max_seqlen_q, meta.max_seqlen_k, seqused_k=meta.seq_lens,
                          block_table=meta.block_tables, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out
