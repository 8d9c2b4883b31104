"""Start-up work a machine does once: FlashAttention-4's JIT kernels and Triton's compiled kernels persist under
nanoplug's cache root."""
from __future__ import annotations

import os

from nanoplug.plugins.attention import flash


def test_fa4_kernels_are_kept_under_the_cache_root_per_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", raising=False)
    monkeypatch.setattr(flash.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash.torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(flash.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    flash.persist_fa4_kernels()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "flash-attn4" / "NVIDIA-H200-sm90")


def test_a_users_own_fa4_cache_setting_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "mine"))
    flash.persist_fa4_kernels()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_cuda_platform_keeps_triton_kernels_in_nanoplugs_cache(monkeypatch, tmp_path):
    from nanoplug.plugins.platforms.cuda.platform import persist_triton_kernels

    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    persist_triton_kernels()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/the/user/chose")
    persist_triton_kernels()  # a setting of the user's wins
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/the/user/chose"


def test_fa4_prefills_share_one_kernel_per_kind_whatever_their_query_length(monkeypatch):
    """FA4 compiles a second "static persistent" kernel for prefills whose longest query fits one tile; `flash`
    passes `max_seqlen_q` (an upper bound) of at least FA4_MIN_SEQLEN_Q, so short and long prefills, fresh or
    over cached context, use the same kernel, and a fresh machine compiles half as many."""
    import torch

    from nanoplug.api import AttentionMetadata, AttentionSpec, KVLayer

    calls = []

    def varlen(q, k, v, **kw):
        calls.append(kw)
        return torch.zeros_like(q), None

    monkeypatch.setattr(flash, "load_kernels", lambda: (flash.FlashKernels("FA4", (9, 0), (11, 9), varlen, None, 1), []))
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.35, block_size=16, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    backend = flash.FlashAttention(spec)
    for query, context in ((3, 3), (300, 300), (5, 40), (400, 900)):  # fresh and over cached context, short and long
        meta = AttentionMetadata(
            is_prefill=True, cu_seqlens_q=torch.tensor([0, query], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, context], dtype=torch.int32),
            seq_lens=torch.tensor([context], dtype=torch.int32), slot_mapping=torch.arange(query),
            block_tables=torch.zeros(1, (context + 15) // 16, dtype=torch.int32), max_seqlen_q=query,
            max_seqlen_k=context, query_lens_host=[query], seq_lens_host=[context])
        backend.prepare(meta)
        q = torch.zeros(query, 4, 8, dtype=torch.bfloat16)
        backend.forward(q, q[:, :2], q[:, :2], torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8), KVLayer(0))
    assert [c["max_seqlen_q"] for c in calls] == [flash.FA4_MIN_SEQLEN_Q, 300, flash.FA4_MIN_SEQLEN_Q, 400]
    assert [("page_table" in c) for c in calls] == [False, False, True, True]
