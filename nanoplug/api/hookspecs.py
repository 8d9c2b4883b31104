"""The hook specs a nanoplug plugin implements (one per kind): each adds what it offers to a registrar.

A plugin module implements one or more of these with `@hookimpl` and sets `NANOPLUG_API_VERSION`
to the plugin API version it was written for. Built-ins are declared in nanoplug/registry.toml
instead (one declaration each), so these hooks are the third-party way in.
"""
from __future__ import annotations

import pluggy

PLUGIN_API_VERSION = 3
"""Bumped when a contract of `nanoplug.api` changes incompatibly; the registry refuses plugins built for another.
2: the SDK moved to `nanoplug.api`; narrow `Target`; `platform` kind; KV layers and linear methods.
3: the `weight_format` kind (adapters no longer give a linear method); `Platform.Options`; the KV store's
   `layer`/`attend` (no rotation fields in the step data)."""

PROJECT = "nanoplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

KIND_HOOKS = {
    "attention": "nanoplug_register_attention",
    "kv_cache": "nanoplug_register_kv_cache",
    "model": "nanoplug_register_model",
    "parallel": "nanoplug_register_parallel",
    "adapter": "nanoplug_register_adapter",
    "weight_format": "nanoplug_register_weight_format",
    "platform": "nanoplug_register_platform",
    "structured_output": "nanoplug_register_structured_output",
    "speculator": "nanoplug_register_speculator",
}
"""Plugin kind -> the hook that registers plugins of that kind."""


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


@hookspec
def nanoplug_register_weight_format(register) -> None:
    """Add weight formats: `register.add("int8", Int8Format)` (a WeightFormat subclass)."""


@hookspec
def nanoplug_register_platform(register) -> None:
    """Add platforms (device families): `register.add("npu", NpuPlatform)` (a Platform subclass)."""


@hookspec
def nanoplug_register_structured_output(register) -> None:
    """Add constrained-decoding backends: `register.add("xgrammar", XGrammarBackend)` (a StructuredOutputBackend
    subclass)."""


@hookspec
def nanoplug_register_speculator(register) -> None:
    """Add speculators (proposers of draft tokens): `register.add("ngram", NgramSpeculator)` (a Speculator
    subclass)."""
