"""Model `mistral` (MistralForCausalLM). Llama's decoder with a sliding window on every layer."""
from __future__ import annotations

from nanoplug.api.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    description = "Mistral: Llama's decoder, sliding-window attention on every layer (config sliding_window)"
    qk_norm = False
    qkv_bias = False
