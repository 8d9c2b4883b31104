"""Attention `sdpa`: PyTorch's own attention kernels.

On CUDA in float16/bfloat16, PyTorch's varlen FlashAttention (`varlen_attn`, sdpa_cuda.py) serves
prefill, and paged steps too where it can read the cache's pages (through torch's page tables, or
packed by a Triton kernel): then decode reads no device value on the host and runs under CUDA graphs.
Elsewhere `scaled_dot_product_attention` runs over a padded batch, with keys read from the paged cache
through the block tables, so cached prefixes, chunked prefill and decode all work; the padding and the
causal-with-offset mask are built once per step in `prepare`, not per layer (one mask per sliding window the
model's layers declare). Attention logit soft-capping (Gemma-2) takes the padded and gathered paths, as
matmul, tanh and softmax (softcap.py): PyTorch's kernels have no soft-capping. Decode steps on the CPU
gather live tokens only (paged_decode.py). Each step's path is counted in `paths`, by (step kind, path).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from nanoplug.api import AttentionBackend, AttentionMetadata, Target
from nanoplug.kernels.attention import softcap
from nanoplug.kernels.attention.paged_decode import PagedDecode
from nanoplug.kernels.attention.varlen_sdpa import CudaVarlenAttention


class SdpaAttention(AttentionBackend):
    description = ("PyTorch's attention: varlen FlashAttention on CUDA (CUDA graphs where paged steps are served), "
                   "else scaled_dot_product_attention over a padded batch")
    priority = 50

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if not hasattr(F, "scaled_dot_product_attention"):
            return ["torch lacks scaled_dot_product_attention; pip install 'torch>=2.6'"]
        return []

    def __init__(self, spec):
        super().__init__(spec)
        # on CUDA in fp16/bf16, PyTorch's varlen FlashAttention serves the steps it can (sdpa_cuda.py)
        self.cuda = CudaVarlenAttention(spec) if CudaVarlenAttention.usable(spec) else None
        if self.cuda is not None and self.cuda.pages:  # varlen serves every decode step: graphs can replay them
            self.supports_cuda_graphs = True  # (a padded step builds its index and mask in `prepare`, not replayed)
        self.paths: Counter[tuple[str, str]] = Counter()
        self.fast = False
        # decode steps on the CPU: gather live tokens only (on a GPU the padded path measured faster)
        self.paged_decode = PagedDecode(spec) if spec.device.type == "cpu" else None
        self.decoding = False
        self.cast = spec.cache_dtype != spec.dtype  # a cache of another dtype is read as the model's

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.fast = self.cuda is not None and self.cuda.serves(meta)
        self.decoding = not self.fast and self.paged_decode is not None and self.paged_decode.serves(meta)
        if self.fast:
            self.cuda.prepare(meta)
            path = self.cuda.path
        elif self.decoding:
            self.paged_decode.prepare(meta)
            path = "gathered decode"
        else:
            self._prepare_padded(meta)
            path = "padded"
        self.paths["prefill" if meta.is_prefill else "decode", path] += 1

    def _prepare_padded(self, meta: AttentionMetadata) -> None:
        dev = meta.slot_mapping.device
        q_lens = torch.tensor(meta.query_lens_host, device=dev)
        seq_lens = meta.seq_lens.long()
        num_seqs, max_q = len(meta.query_lens_host), meta.max_seqlen_q
        # where each packed query token sits in the padded [B, Lq] layout
        self.row = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens)
        self.col = torch.arange(self.row.numel(), device=dev) - meta.cu_seqlens_q[:-1].long()[self.row]
        block_size = self.spec.block_size
        num_blocks = (meta.max_seqlen_k + block_size - 1) // block_size
        self.blocks = meta.block_tables[:, :num_blocks].long()
        # no cached context: attend over the new K/V as computed (not the cache's copy: exact whatever
        # the cache's dtype, and no gather)
        self.fresh = not meta.has_cached_context
        q_pos = (seq_lens - q_lens).unsqueeze(1) + torch.arange(max_q, device=dev).unsqueeze(0)  # [B, Lq]
        k_pos = torch.arange(max_q if self.fresh else num_blocks * block_size, device=dev)
        mask = (k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)) & (k_pos.view(1, 1, -1) < seq_lens.view(-1, 1, 1))
        # one mask per window the model's layers use (None: full attention), each [B, 1, Lq, Lk]
        self.masks = {w: (mask if w is None else mask & (k_pos.view(1, 1, -1) > q_pos.unsqueeze(2) - w)).unsqueeze(1)
                      for w in self.spec.windows}
        self.max_q = max_q

    def forward(self, q, k, v, k_cache, v_cache, layer):
        if self.fast:
            return self.cuda.forward(q, k, v, k_cache, v_cache, layer)
        if self.decoding:
            return self.paged_decode.forward(q, k_cache, v_cache, layer)
        num_seqs = self.blocks.shape[0]
        qp = q.new_zeros(num_seqs, self.max_q, q.shape[1], q.shape[2])
        qp[self.row, self.col] = q
        if self.fresh:
            kp = k.new_zeros(num_seqs, self.max_q, k.shape[1], k.shape[2])
            vp = v.new_zeros(num_seqs, self.max_q, v.shape[1], v.shape[2])
            kp[self.row, self.col], vp[self.row, self.col] = k, v
            kp, vp = kp.transpose(1, 2), vp.transpose(1, 2)
        elif self.cast:  # gathered through an integer view: float8 tensors have few indexing kernels
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[k_cache.dtype.itemsize]
            kp = k_cache.view(bits)[self.blocks].view(k_cache.dtype).flatten(1, 2).transpose(1, 2)
            vp = v_cache.view(bits)[self.blocks].view(v_cache.dtype).flatten(1, 2).transpose(1, 2)
        else:
            kp = k_cache[self.blocks].flatten(1, 2).transpose(1, 2)  # [B, Hkv, Lk, D]
            vp = v_cache[self.blocks].flatten(1, 2).transpose(1, 2)
        if self.cast and not self.fresh:
            kp, vp = layer.dequantize(kp, vp, q.dtype)
        out = softcap.attention(qp.transpose(1, 2), kp, vp, self.masks[self.spec.window(layer.index)], self.spec.scale,
                                self.spec.softcap, enable_gqa=self.spec.num_heads != self.spec.num_kv_heads)
        return out.transpose(1, 2)[self.row, self.col]
