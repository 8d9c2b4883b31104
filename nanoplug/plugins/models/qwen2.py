"""Model `qwen2` (Qwen2ForCausalLM). Qwen2: q/k/v bias, no q/k norm."""
from __future__ import annotations

from nanoplug.api import HERMES_TOOL_CALLS
from nanoplug.api.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    description = "Qwen2: q/k/v bias, no q/k norm"
    qk_norm = False
    qkv_bias = True
    tool_call_formats = (HERMES_TOOL_CALLS,)  # Qwen's chat template: <tool_call>{"name", "arguments"}</tool_call>
