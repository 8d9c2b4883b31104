"""Model `llama` (LlamaForCausalLM). Llama 2/3 and SmolLM2 (rope scaling from the config)."""
from __future__ import annotations

from nanoplug.core.hookspecs import hookimpl
from nanoplug.core.interfaces import PLUGIN_API_VERSION
from nanoplug.plugins.models.decoder import DecoderForCausalLM

NANOPLUG_API_VERSION = PLUGIN_API_VERSION


class LlamaForCausalLM(DecoderForCausalLM):
    description = "Llama 2/3 and SmolLM2 (rope scaling from the config)"
    architectures = ("LlamaForCausalLM",)
    qk_norm = False
    qkv_bias = False


@hookimpl
def nanoplug_register_model(register) -> None:
    register.add("LlamaForCausalLM", LlamaForCausalLM)
