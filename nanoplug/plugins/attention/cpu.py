"""Attention `cpu`: decode steps through a C++ kernel that reads the paged KV cache in place.

On a CPU, `sdpa`'s decode gathers every sequence's keys and values into a padded batch before it
attends (two `index_select`s and a mask per layer); for a small model that costs as much as the
attention itself. This backend's decode kernel (nanoplug/kernels/cpu) walks each sequence's block
table instead, with the query heads of a KV head sharing each K/V read, split over torch's threads.
Prefill and mixed steps, where PyTorch's CPU flash kernel does well, go through `sdpa`'s path, and so does
the decode of sliding-window layers and of soft-capped attention (sdpa's gathered decode, masked per window):
the C++ kernel reads whole contexts and has no soft-capping.
float32 steps, over a float32 or float16 (`kv_cache="fp16"`) cache; the kernels are compiled once per machine at first use (a C++ compiler is needed).
"""
from __future__ import annotations

import torch

from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.api import AttentionMetadata, Target
from nanoplug.kernels.attention.paged_decode import PagedDecode
from nanoplug.plugins.attention.sdpa import SdpaAttention


class CpuAttention(SdpaAttention):
    description = "C++ decode kernel on the paged cache (float32 CPU, built once per machine); prefill via sdpa"
    priority = 60
    supports_cuda_graphs = True  # decode reads the step's tensors only: the cpu platform replays recordings

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = super().unavailable(target)
        if target.device.type != "cpu":
            reasons.append(f"runs on the CPU, not {target.device.type}; use flash, xformers or sdpa there")
        if target.dtype != torch.float32:
            reasons.append(f"float32 only, this run is {str(target.dtype).removeprefix('torch.')}; use sdpa")
        elif target.cache_dtype not in (torch.float32, torch.float16):
            reasons.append(f"reads a float32 or float16 cache, not {str(target.cache_dtype).removeprefix('torch.')}; "
                           "use sdpa")
        facts = target.model
        if facts is not None:
            if facts.head_dim not in cpu_kernels.DECODE_HEAD_DIMS:
                reasons.append(f"head size {facts.head_dim} is not one of {cpu_kernels.DECODE_HEAD_DIMS}; use sdpa")
            if facts.num_heads // max(facts.num_kv_heads, 1) > cpu_kernels.MAX_DECODE_GROUP:
                reasons.append(f"more than {cpu_kernels.MAX_DECODE_GROUP} query heads per KV head; use sdpa")
        if not reasons:  # only build where it could serve (never on a GPU machine)
            why = cpu_kernels.unavailable()
            if why is not None:
                reasons.append(why)
        return reasons

    def __init__(self, spec):
        super().__init__(spec)
        self.kernels = cpu_kernels.kernels()
        # decode steps take the kernel, not sdpa's gather; a sliding-window layer's take the gather
        self.paged_decode = None
        self.window_decode = PagedDecode(spec) if spec.windows != {None} or spec.softcap is not None else None
        if self.window_decode is not None:  # its index and masks are built per step in prepare, which a recording
            self.supports_cuda_graphs = False  # does not see: decode runs eager
        self.kernel_decoding = False

    def prepare(self, meta: AttentionMetadata) -> None:
        self.kernel_decoding = PagedDecode.serves(meta)
        if self.kernel_decoding:
            self.meta = meta
            if self.window_decode is not None:
                self.window_decode.prepare(meta)
            return
        super().prepare(meta)

    def forward(self, q, k, v, k_cache, v_cache, layer):
        if self.kernel_decoding:
            meta = self.meta
            if self.spec.window(layer.index) is not None or self.spec.softcap is not None:
                return self.window_decode.forward(q, k_cache, v_cache, layer)
            return self.kernels.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.spec.scale)
        return super().forward(q, k, v, k_cache, v_cache, layer)
