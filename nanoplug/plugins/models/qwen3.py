"""Model `qwen3` (Qwen3ForCausalLM). Qwen3: q/k RMSNorm, grouped-query attention, no q/k/v bias."""
from __future__ import annotations

from nanoplug.core.hookspecs import hookimpl
from nanoplug.core.interfaces import PLUGIN_API_VERSION
from nanoplug.plugins.models.decoder import DecoderForCausalLM

NANOPLUG_API_VERSION = PLUGIN_API_VERSION


class Qwen3ForCausalLM(DecoderForCausalLM):
    description = "Qwen3: q/k RMSNorm, grouped-query attention, no q/k/v bias"
    architectures = ("Qwen3ForCausalLM",)
    qk_norm = True
    qkv_bias = False


@hookimpl
def nanoplug_register_model(register) -> None:
    register.add("Qwen3ForCausalLM", Qwen3ForCausalLM)
