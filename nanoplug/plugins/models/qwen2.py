"""Model `qwen2` (Qwen2ForCausalLM). Qwen2: q/k/v bias, no q/k norm."""
from __future__ import annotations

from nanoplug.core.hookspecs import hookimpl
from nanoplug.core.interfaces import PLUGIN_API_VERSION
from nanoplug.plugins.models.decoder import DecoderForCausalLM

NANOPLUG_API_VERSION = PLUGIN_API_VERSION


class Qwen2ForCausalLM(DecoderForCausalLM):
    description = "Qwen2: q/k/v bias, no q/k norm"
    architectures = ("Qwen2ForCausalLM",)
    qk_norm = False
    qkv_bias = True


@hookimpl
def nanoplug_register_model(register) -> None:
    register.add("Qwen2ForCausalLM", Qwen2ForCausalLM)
