"""Attention `flash`: FlashAttention kernels reading the paged KV cache directly.

Two builds can serve, tried in this order: the `flash_attn` package (FlashAttention-2:
`flash_attn_varlen_func` with `block_table`, `flash_attn_with_kvcache` for decode), and
FlashAttention-4 (`flash_attn.cute`, package `flash-attn-4`: one `flash_attn_varlen_func` with
`page_table` + `seqused_k` for paged prefill, and the same function on a batch of one-token
queries for decode). Prefill without cached context attends
over the new K/V themselves (no page indirection); chunked prefill, prefix-cache hits and decode
read keys through the block tables. Causal masks align to the bottom right, which is exactly "new
queries at the end of their context". No host sync, so decode runs inside CUDA graphs, and so do
small prefills without cached context (their kernels take `max_seqlen_q` as a bound: a captured one
passes its bucket's token count).

Decode steps on a Hopper GPU with FA4 go to our Triton flash-decoding kernel (triton_decode.py) instead:
FA4 refuses to split a context there (num_splits > 1 is unsupported on SM 9.0), so each (sequence, KV
head) is one program and a decode step waits on its longest context; the Triton kernel splits each
context evenly when the batch is small, and was faster on every sampled batch of the bench run
(benchmarks/gpu_decode_workload.py; RESULTS.md).

FlashAttention reads 16-bit caches only (FA4 asserts q, k, v share a 16-bit dtype; it has no fp8 path). A
float8 cache (`kv_cache="fp8"`) is read by the same Triton kernel in decode steps, and by FlashAttention
over the referenced pages dequantized in prefill steps with cached context (dequantized_pages.py);
prefill without cached context attends over the new 16-bit K/V.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nanoplug.api import AttentionBackend, AttentionMetadata, Target
from nanoplug.api.disk_cache import cache_root
from nanoplug.kernels.attention import triton_decode
from nanoplug.kernels.attention.dequantized_pages import DequantizedPages
from nanoplug.kernels.attention.rotated_cache import RotatedCacheReader

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


def persist_fa4_kernels() -> None:
    """FlashAttention-4 JIT-compiles each kernel variant on first use, seconds each, in every new process;
    its own disk cache (off unless asked for, read when flash_attn.cute is imported) keeps them across
    runs, keyed by FA4's source fingerprint and compile key. The folder adds the GPU, so a cache copied to
    another machine is not reused. A setting of the user's wins."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = re.sub(r"[^A-Za-z0-9.]+", "-", torch.cuda.get_device_name()) + f"-sm{major}{minor}"
    else:
        gpu = "no-gpu"
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(cache_root() / "flash-attn4" / gpu))


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
    persist_fa4_kernels()
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func  # FlashAttention-4
    except Exception as exc:
        errors.append(f"flash_attn.cute (FA4): {type(exc).__name__}: {exc}")
    else:
        return FlashKernels("FA4", (9, 0), (11, 9), flash_attn_varlen_func, None, 1), errors
    return None, errors


# FA4 builds a separate "static persistent" kernel for prefills whose longest query fits one tile group
# (`max_seqlen_q` at most 64-128 tokens), which doubles its JIT variants: seconds each on a fresh machine.
# `max_seqlen_q` is only an upper bound, so prefills pass at least this and every prefill shares one kernel
# per kind (fresh, over cached context); a short prefill's spare query tiles exit at once.
FA4_MIN_SEQLEN_Q = 257


def splits_decode(kernels: FlashKernels | None, device: torch.device) -> bool:
    """Decode by the Triton split kernel rather than FA4's own: on SM 9.x, where FA4 cannot split a context."""
    return (kernels is not None and kernels.name == "FA4" and triton_decode.triton is not None
            and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9)


class FlashAttention(AttentionBackend, RotatedCacheReader):
    description = ("FlashAttention-2 (flash-attn) or FlashAttention-4 (flash-attn-4), paged, CUDA graphs; on Hopper "
                   "decode by a Triton split kernel")
    priority = 100
    supports_cuda_graphs = True
    supports_prefill_graphs = True

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
        if target.cache_dtype == torch.float8_e4m3fn:  # decode by our Triton kernel, prefill over dequantized pages
            if triton_decode.triton is None:
                reasons.append(f"a float8 cache is read by a Triton kernel, and triton is not importable "
                               f"({triton_decode.TRITON_ERROR}); pip install triton")
        elif target.cache_dtype != target.dtype:
            reasons.append(f"reads a cache of the model's dtype or float8_e4m3fn only, not "
                           f"{str(target.cache_dtype).removeprefix('torch.')}; use kv_cache='torch' or 'triton'")
        if model is not None and model.attn_softcap is not None and (
                kernels.name != "FA2" or target.cache_dtype != target.dtype):
            reasons.append("attention logit soft-capping (attn_logit_softcapping) is served by FlashAttention-2 over a "
                           f"cache of the model's dtype only ({kernels.name} here, or a float8 cache, decodes by a "
                           "Triton kernel without it); pip install flash-attn, or use attention='sdpa'")
        block = target.block_size
        if block % kernels.block_multiple:
            reasons.append(f"{kernels.name} paged attention needs kv_block_size a multiple of "
                           f"{kernels.block_multiple} (got {block})")
        return reasons

    def __init__(self, spec):
        super().__init__(spec)
        self.kernels, _ = load_kernels()
        # decode by our Triton kernel over a float8 cache, and on Hopper (splits_decode); a float8 cache's prefill
        # over cached context reads dequantized pages
        self.fp8 = spec.cache_dtype != spec.dtype
        split = self.fp8 or splits_decode(self.kernels, spec.device)
        self.split_decode = triton_decode.TritonDecode(spec) if split else None
        self.fp8_pages = DequantizedPages() if self.fp8 else None
        self.split_step = False
        # it reads a float8 cache only through `paged_decode` (which turns q and the output) and dequantized
        # pages (turned back as they are read): the store's K and V GEMMs around it are not needed
        self.reads_rotated_cache = self.fp8

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta  # padding in the block tables names the scratch block: every entry is a real page
        self.paged = not meta.is_prefill or meta.has_cached_context
        self.split_step = self.split_decode is not None and self.paged and self.split_decode.serves(meta)
        if self.split_step:
            self.split_decode.prepare(meta)
        elif self.fp8 and self.paged:
            self.fp8_pages.prepare(meta, self.spec.block_size)

    def forward(self, q, k, v, k_cache, v_cache, layer):
        meta, window = self.meta, self.spec.window(layer.index)
        options = {"softmax_scale": self.spec.scale}
        if window is not None:  # a sliding-window layer: FlashAttention's window_size, w - 1 keys back and itself
            options["window_size"] = (window - 1, 0)
        if self.spec.softcap is not None:  # FlashAttention-2's (unavailable() refuses it elsewhere)
            options["softcap"] = self.spec.softcap
        if self.split_step:
            return self.split_decode.forward(q, k_cache, v_cache, layer)
        if self.fp8 and self.paged:
            k_cache, v_cache, meta = self.fp8_pages.gather(k_cache, v_cache, layer, q.dtype)
        if self.kernels.name == "FA2":
            return self._fa2(q, k, v, k_cache, v_cache, meta, options)
        if not self.paged:
            bound = max(meta.max_seqlen_q, FA4_MIN_SEQLEN_Q)
            out = self.kernels.varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_q,
                                      max_seqlen_q=bound, max_seqlen_k=bound, **options, causal=True)
        elif not meta.is_prefill:
            # decode as a batch of one-token queries [B, 1, H, D], not varlen: no per-call tile
            # scheduling, 25% faster on the H200 (benchmarks/gpu_decode_attention.py)
            out = self.kernels.varlen(q.unsqueeze(1), k_cache, v_cache, seqused_k=meta.seq_lens,
                                      page_table=meta.block_tables, **options, causal=True)
            out = out[0] if isinstance(out, tuple) else out
            return out.squeeze(1)
        else:
            out = self.kernels.varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seq_lens,
                                      max_seqlen_q=max(meta.max_seqlen_q, FA4_MIN_SEQLEN_Q),
                                      page_table=meta.block_tables, **options, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def _fa2(self, q, k, v, k_cache, v_cache, meta, options):
        if meta.is_prefill and not meta.has_cached_context:
            return self.kernels.varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q,
                                       meta.max_seqlen_q, **options, causal=True)
        if meta.is_prefill:
            return self.kernels.varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                       meta.max_seqlen_k, **options, causal=True,
                                       block_table=meta.block_tables)
        out = self.kernels.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                        block_table=meta.block_tables, **options, causal=True)
        return out.squeeze(1)

