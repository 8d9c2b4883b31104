"""nanoplug: a lightweight LLM inference engine whose every part is a plugin."""
from nanoplug.core.config import AdapterSpec, EngineConfig, SamplingParams
from nanoplug.core.engine import LLM, CompletionOutput, RequestOutput, StreamDelta
from nanoplug.core.logprobs import TokenLogprobs
from nanoplug.core.hookspecs import hookimpl
from nanoplug.core.interfaces import PLUGIN_API_VERSION

__all__ = ["LLM", "AdapterSpec", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta",
           "TokenLogprobs", "hookimpl", "PLUGIN_API_VERSION"]
__version__ = "0.1.0"
