"""The base of the mixture-of-experts model plugins: the generic decoder with a `SparseMoeBlock` as the MLP of
its sparse layers, and the config checks they share.

A config field that changes what transformers computes is honoured or refused with its reason: sparse layers
follow `decoder_sparse_step` and `mlp_only_layers` (the others keep a dense MLP of `intermediate_size`, as in
transformers), a sliding window is refused unless it spans the engine's whole context (then it changes nothing).
Training-only fields (router aux loss, router logits output, jitter noise, dropout) do not change inference.
"""
from __future__ import annotations

from typing import Any

from nanoplug.api import ModelLoadError
from nanoplug.api.decoder import DecoderForCausalLM, DecoderMLP
from nanoplug.api.layers import SparseMoeBlock

CONFIG_FIX = "use the config.json saved with the weights"


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """Subclasses set `experts_field`, the checkpoint's module names and `router_renormalize(cfg)`."""

    experts_field = "num_experts"  # config field: how many experts (Mixtral: num_local_experts)
    expert_intermediate_field = "moe_intermediate_size"  # Mixtral: intermediate_size
    block_name = "mlp"  # checkpoint module of the MoE block (Mixtral: block_sparse_moe)
    expert_parts = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
    shared_expert = False
    # the experts' fields are read by build_mlp / is_sparse / router_renormalize; the router's training-only fields
    # (aux loss, logits output, jitter noise) do not change inference
    honoured_fields = DecoderForCausalLM.honoured_fields | {
        "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias",
        "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
    }

    def __init__(self, hf_config: Any, layers, attention_factory, max_positions: int | None = None):
        self.check_config(hf_config, max_positions)
        num_experts = int(getattr(hf_config, self.experts_field))
        mapping = {}
        for e in range(num_experts):  # experts.N.gate_proj -> part (N, 0) of experts.gate_up_proj, ...
            for source, (fused, part) in self.expert_parts.items():
                mapping[f"{self.block_name}.experts.{e}.{source}"] = (f"mlp.experts.{fused}",
                                                                       e if part is None else (e, part))
        if self.block_name != "mlp":
            mapping[f"{self.block_name}.gate"] = ("mlp.gate", None)
        self.packed_modules_mapping = {**mapping, **type(self).packed_modules_mapping}
        super().__init__(hf_config, layers, attention_factory, max_positions)

    def router_renormalize(self, cfg: Any) -> bool:
        return bool(cfg.norm_topk_prob)

    def is_sparse(self, cfg: Any, layer_idx: int) -> bool:
        """transformers' rule (Qwen2/3-MoE): experts unless the layer is in mlp_only_layers or off the sparse step."""
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
                and getattr(cfg, self.experts_field) > 0 and (layer_idx + 1) % step == 0)

    def build_mlp(self, cfg: Any, layers, layer_idx: int):
        if not self.is_sparse(cfg, layer_idx):
            return DecoderMLP(cfg, layers)
        shared = None
        if self.shared_expert:
            shared = DecoderMLP(cfg, layers, intermediate_size=cfg.shared_expert_intermediate_size)
        return SparseMoeBlock(layers, cfg.hidden_size, getattr(cfg, self.experts_field), cfg.num_experts_per_tok,
                              getattr(cfg, self.expert_intermediate_field), self.router_renormalize(cfg), shared)

    @classmethod
    def check_config(cls, cfg: Any, max_positions: int | None) -> None:
        """Refuse what would load and compute something else than transformers."""
        name = cls.__name__
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{name}: hidden_act {act!r} is not served (the experts and MLPs are SwiGLU, silu); "
                                 f"{CONFIG_FIX}")
        window = cls.sliding_window(cfg)
        if window is not None and (max_positions is None or window < max_positions):
            raise ModelLoadError(
                f"{name}: a sliding window of {window} tokens is not served by this model plugin yet (its attention "
                f"would be full, unlike transformers', past {window} tokens); pass max_model_len <= {window}, where "
                "the window changes nothing")
        step = getattr(cfg, "decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ModelLoadError(f"{name}: decoder_sparse_step must be a positive integer, found {step!r}; {CONFIG_FIX}")

    @classmethod
    def sliding_window(cls, cfg: Any) -> int | None:
        """The window some layer attends in, per transformers, or None (Qwen: only with use_sliding_window)."""
        if not getattr(cfg, "use_sliding_window", False):
            return None
        return getattr(cfg, "sliding_window", None) or None
