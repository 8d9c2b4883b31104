"""Model `llama` (LlamaForCausalLM). Llama 2/3 and SmolLM2 (rope scaling from the config)."""
from __future__ import annotations

from nanoplug.api.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    description = "Llama 2/3 and SmolLM2 (rope scaling from the config)"
    qk_norm = False
    qkv_bias = False

