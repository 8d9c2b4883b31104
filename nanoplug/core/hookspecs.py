"""The five hook specs a nanoplug plugin implements: each adds what it offers to a registrar.

A plugin module implements one or more of these with `@nanoplug.hookimpl` and sets
`NANOPLUG_API_VERSION` to the plugin API version it was written for.
"""
from __future__ import annotations

import pluggy

from nanoplug.core.interfaces import PLUGIN_API_VERSION

PROJECT = "nanoplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["PLUGIN_API_VERSION", "hookimpl", "hookspec"]


@hookspec
def nanoplug_register_attention(register) -> None:
    """Add attention backends: `register.add("flash", FlashBackend)` (an AttentionBackend subclass)."""


@hookspec
def nanoplug_register_kv_cache(register) -> None:
    """Add KV-cache stores: `register.add("triton", TritonStore)` (a KVCacheStore subclass)."""


@hookspec
def nanoplug_register_model(register) -> None:
    """Add model architectures keyed by the Hugging Face `architectures` name:
    `register.add("Qwen3ForCausalLM", Qwen3ForCausalLM)`."""


@hookspec
def nanoplug_register_parallel(register) -> None:
    """Add parallel strategies: `register.add("tensor", TensorParallel)` (a ParallelStrategy subclass)."""


@hookspec
def nanoplug_register_adapter(register) -> None:
    """Add weight adapters: `register.add("lora", LoraAdapter)` (a WeightAdapter subclass)."""
