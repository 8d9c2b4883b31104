"""Model `qwen2_moe` (Qwen2MoeForCausalLM). Qwen2-MoE: q/k/v bias (`qkv_bias`), softmax top-k experts
(renormalised when `norm_topk_prob`) plus a shared expert scaled by a sigmoid gate."""
from __future__ import annotations

from typing import Any

from nanoplug.api import HERMES_TOOL_CALLS
from nanoplug.plugins.models.moe_decoder import MoeDecoderForCausalLM


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    description = "Qwen2-MoE: q/k/v bias, softmax top-k experts and a sigmoid-gated shared expert"
    tool_call_formats = (HERMES_TOOL_CALLS,)  # Qwen's chat template: <tool_call>{"name", "arguments"}</tool_call>
    qk_norm = False
    shared_expert = True

    def __init__(self, hf_config: Any, layers, attention_factory, max_positions: int | None = None):
        self.qkv_bias = bool(getattr(hf_config, "qkv_bias", True))  # transformers' default: biased q/k/v
        super().__init__(hf_config, layers, attention_factory, max_positions)

    @classmethod
    def sliding_window(cls, cfg: Any) -> int | None:
        """Qwen2-MoE slides only in the layers its `layer_types` mark (from use_sliding_window, max_window_layers)."""
        types = getattr(cfg, "layer_types", None) or []
        if "sliding_attention" not in types and not getattr(cfg, "use_sliding_window", False):
            return None
        return getattr(cfg, "sliding_window", None) or None
