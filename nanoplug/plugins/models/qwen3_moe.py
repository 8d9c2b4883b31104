"""Model `qwen3_moe` (Qwen3MoeForCausalLM). Qwen3-MoE: Qwen3's attention (q/k RMSNorm), experts routed by softmax
then top-k, renormalised when `norm_topk_prob`."""
from __future__ import annotations

from nanoplug.api import HERMES_TOOL_CALLS
from nanoplug.plugins.models.moe_decoder import MoeDecoderForCausalLM


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    description = "Qwen3-MoE: q/k RMSNorm, softmax top-k experts (norm_topk_prob), sparse step and mlp_only_layers"
    tool_call_formats = (HERMES_TOOL_CALLS,)  # Qwen's chat template: <tool_call>{"name", "arguments"}</tool_call>
    qk_norm = True
    qkv_bias = False
