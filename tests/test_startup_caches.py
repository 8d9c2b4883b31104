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
