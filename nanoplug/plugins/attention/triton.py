"""Attention `triton`: decode steps by our Triton paged flash-decoding kernel, which reads the cache as
stored (a float8 cache with its scales, or a plain one); prefill steps by `sdpa`'s paths, reading a
cache of another dtype through its scales.

It exists for caches FlashAttention cannot read and for GPUs without FlashAttention; where FlashAttention
serves, `flash` is faster in prefill and delegates float8 decode to the same kernel.
"""
from __future__ import annotations

import torch

from nanoplug.api import AttentionMetadata, Target, triton_reasons
from nanoplug.kernels.attention import triton_decode
from nanoplug.kernels.attention.rotated_cache import RotatedCacheReader
from nanoplug.plugins.attention.sdpa import SdpaAttention


class TritonAttention(SdpaAttention, RotatedCacheReader):
    description = "Triton paged flash-decoding (reads fp8 caches), sdpa for prefill; CUDA graphs"
    priority = 45  # below sdpa: "auto" picks it only where sdpa cannot serve
    supports_cuda_graphs = True  # decode reads no device value on the host; prefill is never captured

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = super().unavailable(target) + triton_reasons(triton_decode.TRITON_ERROR, target.device.type)
        if target.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"needs dtype float16, bfloat16 or float32 (got {target.dtype})")
        if target.cache_dtype not in (target.dtype, torch.float8_e4m3fn):
            reasons.append(f"reads a cache of the model's dtype or float8_e4m3fn, not {target.cache_dtype}")
        model = target.model
        if model is not None and model.head_dim > 256:
            reasons.append(f"head size {model.head_dim} unsupported (at most 256)")
        if model is not None and model.attn_softcap is not None:
            reasons.append("attention logit soft-capping (attn_logit_softcapping) is not in the Triton decode kernel; "
                           "use attention='sdpa' or 'flash' (FlashAttention-2)")
        return reasons

    def __init__(self, spec):
        super().__init__(spec)
        self.decode = triton_decode.TritonDecode(spec)
        self.triton_step = False
        # decode by `paged_decode`, which turns q and the output; prefill reads a cache of another dtype only through
        # `layer.dequantize`, which turns K and V back
        self.reads_rotated_cache = self.cast

    def prepare(self, meta: AttentionMetadata) -> None:
        self.triton_step = self.decode.serves(meta)
        if self.triton_step:
            self.meta = meta
            return self.decode.prepare(meta)
        super().prepare(meta)

    def forward(self, q, k, v, k_cache, v_cache, layer):
        if self.triton_step:
            return self.decode.forward(q, k_cache, v_cache, layer)
        return super().forward(q, k, v, k_cache, v_cache, layer)
