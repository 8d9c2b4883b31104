"""Model `qwen3` (Qwen3ForCausalLM). Qwen3: q/k RMSNorm, grouped-query attention, no q/k/v bias."""
from __future__ import annotations

from nanoplug.api import HERMES_TOOL_CALLS
from nanoplug.api.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    description = "Qwen3: q/k RMSNorm, grouped-query attention, no q/k/v bias"
    qk_norm = True
    qkv_bias = False
    tool_call_formats = (HERMES_TOOL_CALLS,)  # Qwen's chat template: <tool_call>{"name", "arguments"}</tool_call>
