"""Attention `xformers`: `xformers.ops` memory-efficient attention.

Prefill without cached context attends over the new K/V with a block-diagonal causal mask (one
block per sequence). Chunked prefill and prefix-cache hits read keys from the paged cache through
xformers' paged mask (`PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`); if no xformers operator
on this GPU takes it for such queries, the keys of each sequence are gathered from their pages and a
bottom-right causal block-diagonal mask is used instead (same result, more copying).

Decode runs under CUDA graphs: its paged mask is built once per step layout over the metadata's own
device tensors (sequence lengths, block tables), with fixed upper bounds as its host-side lengths, so
a replay reads that step's lengths and tables. It runs one operator, named rather than dispatched:
`triton_splitk.FwOp`, xformers' split-K decode kernel, because it reads paged keys natively with GQA
and derives its launch from shapes alone (no host sync); FlashAttention's paged forward needs the
flash-attn 2 package (PyTorch's own FlashAttention has no block tables) and flash3's the flash_attn_3
package, and xformers' dispatch skips split-K for more than 32 queries.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import weakref

import torch

from nanoplug.api import AttentionBackend, AttentionMetadata, Target
log = logging.getLogger("nanoplug")


@functools.lru_cache(maxsize=None)
def load_xformers():
    """(xformers.ops, attn_bias module) or (None, why). xformers 0.0.35 raises on import when
    flash_attn.cute is importable (it takes it for FlashAttention-2): that is a reason, not a crash."""
    try:
        import xformers.ops as xops
        from xformers.ops.fmha import attn_bias
    except Exception as exc:
        return None, f"xformers does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return (xops, attn_bias), None


class XformersAttention(AttentionBackend):
    description = "xformers memory-efficient attention (block-diagonal and paged masks), CUDA graphs"
    priority = 80
    supports_cuda_graphs = True

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if target.device.type != "cuda":
            return [f"needs CUDA (device is {target.device.type}); use attention='cpu', 'sdpa' or 'manual' on CPU"]
        reasons = []
        if target.dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"needs dtype float16 or bfloat16 (got {str(target.dtype).removeprefix('torch.')}); "
                           "pass dtype='bfloat16'")
        if target.cache_dtype != target.dtype:
            reasons.append(f"reads a cache of the model's dtype only, not {str(target.cache_dtype).removeprefix('torch.')}; "
                           "use kv_cache='torch' or 'triton'")
        if target.block_size % 64:  # triton_splitk's key tile
            reasons.append(f"decode by xformers' triton_splitk needs kv_block_size a multiple of 64 "
                           f"(got {target.block_size})")
        if importlib.util.find_spec("triton") is None:
            reasons.append("decode by xformers' triton_splitk needs triton; pip install triton")
        if target.model is not None and target.model.has_sliding_window:
            reasons.append("sliding-window layers are not served: xformers' local masks (e.g. "
                           "PagedBlockDiagonalCausalLocalPaddedKeysMask) are not wired into this backend, whose paged "
                           "decode runs triton_splitk over BlockDiagonalCausalWithOffsetPaddedKeysMask; use "
                           "attention='flash', 'triton' or 'sdpa'")
        if target.model is not None and target.model.attn_softcap is not None:
            reasons.append("attention logit soft-capping (attn_logit_softcapping) is not in xformers' attention "
                           "operators; use attention='sdpa' or 'flash' (FlashAttention-2)")
        lib, why = load_xformers()
        if lib is None:
            reasons.append(f"{why}; pip install xformers (a build matching this torch), and if flash_attn.cute "
                           "(flash-attn-4) is installed, run xformers in a process where it is not importable")
        return reasons

    @classmethod
    def passed_over(cls, target: Target) -> list[str]:
        if target.decode_query_len > 1:
            return [f"it verifies speculative drafts ({target.decode_query_len} query rows a sequence) by gathering "
                    "each sequence's keys out of their pages (no xformers operator takes a paged mask for such "
                    "queries), far slower than a plain decode step; attention='flash' or 'triton' read the pages "
                    "directly"]
        return []

    def __init__(self, spec):
        super().__init__(spec)
        (self.xops, self.bias_mod), _ = load_xformers()
        self.decode_op = self.xops.fmha.triton_splitk.FwOp  # what every decode step runs (the module's docstring)
        self.use_paged = True  # turned off once if no operator takes paged masks for prefill queries here
        self.group = spec.num_heads // spec.num_kv_heads
        self.decode_masks: dict[int, object] = {}  # id(meta) -> its decode mask, while that meta lives

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        b = self.bias_mod
        q_lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
        if not meta.is_prefill:
            self.bias = self._decode_mask(meta)
            self.mode = "decode"
        elif not meta.has_cached_context:
            self.bias = b.BlockDiagonalCausalMask.from_seqlens(q_lens, device=meta.slot_mapping.device)
            self.mode = "fresh"
        elif self.use_paged:
            self.bias = b.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                q_seqlen=q_lens, kv_seqlen=seq_lens, block_tables=meta.block_tables, page_size=self.spec.block_size,
                device=meta.slot_mapping.device)
            self.mode = "paged"
        else:
            self._prepare_gather(meta)

    def _decode_mask(self, meta: AttentionMetadata):
        """The paged mask of a decode step over `meta`'s own tensors: one query per sequence, keys up to
        `seq_lens`, pages from `block_tables`. Its host-side fields are fixed bounds (a query each, keys
        padded to the table's width), not this step's lengths, so a graph replay with new values in the
        same tensors is served by the mask captured. Kept as long as `meta` lives: a graph's meta comes
        back on every replay, and the key starts it holds must outlive the graph."""
        key = id(meta)
        if key in self.decode_masks:
            return self.decode_masks[key]
        b, page = self.bias_mod, self.spec.block_size
        rows, width = meta.block_tables.shape
        pad = width * page
        starts = list(range(rows + 1))
        q_info = b._SeqLenInfo(seqstart=meta.cu_seqlens_q, max_seqlen=1, min_seqlen=1, seqstart_py=starts)
        k_info = b._PaddedSeqLenInfo(seqstart=meta.cu_seqlens_q * pad, max_seqlen=pad, min_seqlen=1,
                                     seqstart_py=[i * pad for i in starts], seqlen=meta.seq_lens,
                                     seqlen_py=[pad] * rows, padding=pad)
        mask = b.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(q_seqinfo=q_info, k_seqinfo=k_info,
                                                                   block_tables=meta.block_tables, page_size=page)
        self.decode_masks[key] = mask
        weakref.finalize(meta, self.decode_masks.pop, key, None)
        return mask

    def _prepare_gather(self, meta: AttentionMetadata) -> None:
        """Flat indices of every context token of every sequence in the flattened cache."""
        bs, dev = self.spec.block_size, meta.slot_mapping.device
        seq_lens = meta.seq_lens.long()
        seq_idx = torch.repeat_interleave(torch.arange(len(meta.seq_lens_host), device=dev), seq_lens)
        pos = torch.arange(seq_idx.numel(), device=dev) - meta.cu_seqlens_k[:-1].long()[seq_idx]
        self.gather_idx = meta.block_tables.long()[seq_idx, pos // bs] * bs + pos % bs
        self.bias = self.bias_mod.BlockDiagonalCausalFromBottomRightMask.from_seqlens(
            meta.query_lens_host, meta.seq_lens_host, device=dev)
        self.mode = "gather"

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """[T, Hkv, D] -> [1, T, Hkv, group, D], xformers' grouped-query layout (a view)."""
        t, hkv, d = x.shape
        return x.view(1, t, hkv, 1, d).expand(1, t, hkv, self.group, d)

    def forward(self, q, k, v, k_cache, v_cache, layer):
        n, h, d = q.shape
        qg = q.view(1, n, self.spec.num_kv_heads, self.group, d)
        op = self.decode_op if self.mode == "decode" else None  # None: xformers dispatches
        if self.mode == "fresh":
            keys, values = self._grouped(k), self._grouped(v)
        elif self.mode in ("paged", "decode"):
            keys, values = self._grouped(k_cache.view(-1, *k_cache.shape[2:])), self._grouped(v_cache.view(-1, *v_cache.shape[2:]))
        else:
            flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
            keys, values = self._grouped(flat_k[self.gather_idx]), self._grouped(flat_v[self.gather_idx])
        try:
            out = self.xops.memory_efficient_attention_forward(qg, keys, values, attn_bias=self.bias,
                                                               scale=self.spec.scale, op=op)
        except (NotImplementedError, ValueError) as exc:
            if self.mode != "paged":
                raise
            log.warning("xformers: no operator takes paged masks for these queries here (%s); gathering keys "
                        "instead", str(exc).splitlines()[0])
            self.use_paged = False
            self._prepare_gather(self.meta)
            return self.forward(q, k, v, k_cache, v_cache, layer)
        return out.reshape(n, h, d)
