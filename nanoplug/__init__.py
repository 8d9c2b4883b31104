"""nanoplug: a lightweight LLM inference engine whose every part is a plugin.

The user's surface is `LLM`, `SamplingParams` and `EngineConfig`; plugins import `nanoplug.api`.
The engine is imported on first use of its names, so `import nanoplug.api` (a plugin, a worker
process) does not load it.
"""
from __future__ import annotations

from typing import Any

from nanoplug.api.hookspecs import PLUGIN_API_VERSION, hookimpl

__all__ = ["LLM", "AdapterSpec", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "StreamDelta",
           "TokenLogprobs", "Registry", "hookimpl", "PLUGIN_API_VERSION"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "nanoplug.engine.llm",
    "RequestOutput": "nanoplug.engine.outputs",
    "CompletionOutput": "nanoplug.engine.outputs",
    "StreamDelta": "nanoplug.engine.outputs",
    "TokenLogprobs": "nanoplug.worker.logprobs",
    "AdapterSpec": "nanoplug.config",
    "EngineConfig": "nanoplug.config",
    "SamplingParams": "nanoplug.config",
    "StructuredOutputsParams": "nanoplug.config",
    "Registry": "nanoplug.engine.registry",  # the plugins this process sees: LLM(path, registry=...)
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nanoplug' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
