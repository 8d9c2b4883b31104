"""Model `llama` (LlamaForCausalLM). Llama 2/3 and SmolLM2 (rope scaling from the config)."""
from __future__ import annotations

from nanoplug.api import HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS
from nanoplug.api.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    description = "Llama 2/3 and SmolLM2 (rope scaling from the config)"
    qk_norm = False
    qkv_bias = False
    # SmolLM2-Instruct was tuned on <tool_call> JSON calls (Hermes'); Llama 3.1+'s template (<|python_tag|>) writes
    # bare JSON calls
    tool_call_formats = (HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS)
