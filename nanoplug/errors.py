"""Errors a user sees: each says what went wrong and how to fix it. Those a plugin may raise too are
defined in the SDK (`nanoplug.api.errors`) and re-exported here; the engine's own follow."""
from nanoplug.api.errors import (AdapterError, GraphCaptureError, ModelLoadError, NanoplugError,  # noqa: F401
                                 PluginLoadError, PluginUnavailableError, RequestError, UnknownPluginError, WeightShapeError)


class ConfigError(NanoplugError, ValueError):
    """A setting that does not fit this model (e.g. max_model_len past its context length)."""


class EngineClosedError(NanoplugError, RuntimeError):
    """A request to an LLM after close()."""
