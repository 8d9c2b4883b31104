"""Model `mistral` (MistralForCausalLM). Llama's decoder with a sliding window on every layer."""
from __future__ import annotations

from nanoplug.api import HERMES_TOOL_CALLS, MISTRAL_TOOL_CALLS
from nanoplug.api.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    description = "Mistral: Llama's decoder, sliding-window attention on every layer (config sliding_window)"
    qk_norm = False
    qkv_bias = False
    # Mistral's v3 template: [TOOL_CALLS][{...}]; Hermes fine-tunes (Hermes 2 Pro) write <tool_call>
    tool_call_formats = (MISTRAL_TOOL_CALLS, HERMES_TOOL_CALLS)
