"""Model `mixtral` (MixtralForCausalLM). Mixtral: Llama's attention, experts routed by softmax, top-k, always
renormalised over the k; checkpoint names `block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down)."""
from __future__ import annotations

from typing import Any

from nanoplug.api import HERMES_TOOL_CALLS, MISTRAL_TOOL_CALLS
from nanoplug.plugins.models.moe_decoder import MoeDecoderForCausalLM


class MixtralForCausalLM(MoeDecoderForCausalLM):
    description = "Mixtral: softmax top-k experts renormalised over the k"
    qk_norm = False
    qkv_bias = False
    # Mistral's v3 template: [TOOL_CALLS][{...}]; Hermes fine-tunes (Hermes 2 Pro) write <tool_call>
    tool_call_formats = (MISTRAL_TOOL_CALLS, HERMES_TOOL_CALLS)
    experts_field = "num_local_experts"
    expert_intermediate_field = "intermediate_size"
    block_name = "block_sparse_moe"
    expert_parts = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}

    def router_renormalize(self, cfg: Any) -> bool:
        return True

    def is_sparse(self, cfg: Any, layer_idx: int) -> bool:
        return True  # every Mixtral layer is sparse

    @classmethod
    def sliding_window(cls, cfg: Any) -> int | None:
        """transformers masks Mixtral's attention to `sliding_window` whenever it is set."""
        return getattr(cfg, "sliding_window", None) or None
