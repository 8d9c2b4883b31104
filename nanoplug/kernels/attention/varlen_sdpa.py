"""The CUDA path of attention `sdpa`: PyTorch's own varlen FlashAttention kernel.

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) runs packed variable-length sequences with no
padding. Prefill without cached context attends over the new K/V. Paged steps (decode, chunked prefill,
prefix hits) read the cache through torch's page tables where this torch takes `block_table` +
`seqused_k` (and the pages hold a multiple of 256 tokens, as its FlashAttention requires); elsewhere (torch
2.11) a Triton kernel first packs each sequence's live pages into one buffer (packed_pages.py). Either way
nothing is read on the host and every shape follows from the batch size and `max_seqlen_k` (the model's
limit in a captured graph), so decode runs inside CUDA graphs. Grouped-query K/V go in unrepeated: the
FlashAttention kernel behind every torch's `varlen_attn` reads them natively (newer torch asks for
`enable_gqa=True`). Keyword names moved between torch releases, so the call is shaped once from the
function's signature.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from nanoplug.api import AttentionMetadata, AttentionSpec
from nanoplug.kernels.attention import packed_pages


def packed_budget(device: torch.device) -> int:
    """Bytes the packed buffer may take (it holds at least one sequence, whatever this says): a small share of
    the GPU's memory, taken before the KV cache is sized, so that a full decode batch of a small model at the
    bench's context length fits in one or two groups."""
    return torch.cuda.get_device_properties(device).total_memory // 64


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
        if spec.device.type != "cuda" or spec.dtype not in (torch.float16, torch.bfloat16):
            return False  # (before the import: torch.nn.attention.varlen loads torch._dynamo, 0.7 s of a CPU start)
        fn, params = _varlen()
        windows_served = spec.windows == {None} or "window_size" in params  # a sliding window needs window_size
        return (fn is not None and spec.cache_dtype == spec.dtype and windows_served and spec.softcap is None)

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.fn, params = _varlen()
        common: dict[str, Any] = {"scale": spec.scale}
        if "enable_gqa" in params and spec.num_heads != spec.num_kv_heads:
            common["enable_gqa"] = True
        windowed = "window_size" in params
        # causal, aligned to the bottom right
        self.causal = {**common, **({"window_size": (-1, 0)} if windowed else {"is_causal": True})}
        # one query per sequence, the last of its context, sees every key: no mask, and then FlashAttention
        # lays the query heads of a KV head out as the rows of one tile (each K/V read once per KV head)
        self.one_query = {**common, **({"window_size": (-1, -1)} if windowed else {"is_causal": False})}
        if windowed:  # a sliding-window layer: w - 1 keys back and itself (FlashAttention's window_size)
            self.windowed = {w: {**common, "window_size": (w - 1, 0)} for w in spec.windows if w is not None}
        self.torch_pages = {"block_table", "seqused_k"} <= params and spec.block_size % 256 == 0
        self.packed = None
        limits = spec.limits
        if not self.torch_pages and packed_pages.triton is not None and limits is not None:
            # allocated now, before the KV cache is sized from the memory left
            self.packed = packed_pages.PackedPages(spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device,
                                                   limits.max_model_len, limits.max_num_seqs,
                                                   packed_budget(spec.device))
        self.pages = self.torch_pages or self.packed is not None  # paged steps served
        self.path = ""

    def serves(self, meta: AttentionMetadata) -> bool:
        return (meta.is_prefill and not meta.has_cached_context) or self.pages

    def prepare(self, meta: AttentionMetadata) -> None:
        """Which call serves the step (`path`, recorded by the backend); the groups of a packed step."""
        self.meta = meta
        if meta.is_prefill and not meta.has_cached_context:
            self.path = "varlen"
        elif self.torch_pages:
            self.path = "varlen, torch's page tables"
        else:
            self.path = "varlen, packed pages"
            self.groups = self.packed.groups(meta)

    def forward(self, q, k, v, k_cache, v_cache, layer) -> torch.Tensor:
        meta = self.meta
        window = self.spec.window(layer.index)
        if window is not None:
            kwargs = self.windowed[window]
        else:
            kwargs = self.one_query if meta.max_seqlen_q == 1 else self.causal
        if self.path == "varlen":
            out = self.fn(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_q,
                          **kwargs)
        elif self.torch_pages:
            out = self.fn(q, k_cache, v_cache, meta.cu_seqlens_q, None, meta.max_seqlen_q, meta.max_seqlen_k,
                          seqused_k=meta.seq_lens, block_table=meta.block_tables, **kwargs)
        else:
            outs = []
            for first, end, q_first, q_end in self.groups:
                keys, values, cu_q, cu_k = self.packed.pack(k_cache, v_cache, meta, first, end)
                part = self.fn(q[q_first:q_end], keys, values, cu_q, cu_k, meta.max_seqlen_q, meta.max_seqlen_k,
                               **kwargs)
                outs.append(part[0] if isinstance(part, tuple) else part)
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        return out[0] if isinstance(out, tuple) else out
