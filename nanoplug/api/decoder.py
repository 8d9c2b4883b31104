"""The decoder-only transformer that Qwen3, Qwen2 and Llama share: RMSNorm, RoPE, grouped-query
attention and a SwiGLU MLP. Model plugins are thin subclasses that set the differences (q/k norm,
q/k/v bias). Parameter names follow Hugging Face checkpoints, so the loader maps them one to one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from nanoplug.api import (ModelArchitecture, PagedAttention, RMSNorm, RotaryEmbedding, SiluAndMul, Target,
                          residual_stream)
from nanoplug.api.config_fields import config_reasons


class DecoderAttention(nn.Module):
    def __init__(self, cfg: Any, layers, attention_factory: Callable[..., PagedAttention], layer_idx: int,
                 qk_norm: bool, qkv_bias: bool, rotary: RotaryEmbedding):
        super().__init__()
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.qkv_proj = layers.qkv(cfg.hidden_size, self.head_dim, heads, kv_heads, bias=qkv_bias)
        self.o_proj = layers.row(heads * self.head_dim, cfg.hidden_size, bias=bool(getattr(cfg, "attention_bias", False)))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = attention_factory(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # the norms go with the rotation: one fused op where the platform has one
            q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: Any, layers, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        intermediate_size = intermediate_size or cfg.intermediate_size  # an MoE's shared expert has its own
        self.gate_up_proj = layers.merged_column(cfg.hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = layers.row(intermediate_size, cfg.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layers, attention_factory, layer_idx, qk_norm, qkv_bias, rotary, mlp_factory=None):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layers, attention_factory, layer_idx, qk_norm, qkv_bias, rotary)
        self.mlp = mlp_factory(cfg, layers, layer_idx) if mlp_factory else DecoderMLP(cfg, layers)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = residual_stream(hidden)
            hidden = self.input_layernorm(residual)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, layers, attention_factory, qk_norm, qkv_bias, max_positions, mlp_factory=None):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max_positions)
        self.embed_tokens = layers.embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layers, attention_factory, i, qk_norm, qkv_bias, rotary, mlp_factory)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module, ModelArchitecture):
    """Base of the model plugins; subclasses set `qk_norm` and `qkv_bias`."""

    qk_norm = False
    qkv_bias = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # ---- config fields (api/config_fields.py): what this decoder implements, and what it runs at one value only
    honoured_fields = frozenset({
        "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "attention_bias",
        "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    })
    fixed_fields: dict[str, Any] = {"hidden_act": "silu"}

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        facts = target.model
        if facts is None or facts.config is None:
            return []
        return config_reasons(facts.config, cls.__name__, cls.honoured_fields, cls.fixed_fields)

    def __init__(self, hf_config: Any, layers, attention_factory, max_positions: int | None = None):
        super().__init__()
        max_positions = max(max_positions or 0, getattr(hf_config, "max_position_embeddings", 0) or 0, 1)
        self.model = DecoderModel(hf_config, layers, attention_factory, self.qk_norm,
                                  self.qkv_bias or getattr(hf_config, "attention_bias", False), max_positions,
                                  self.build_mlp)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = layers.lm_head(hf_config.vocab_size, hf_config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    build_mlp = None
    """`(cfg, layers, layer_idx) -> nn.Module`: a layer's MLP where a subclass has its own (mixture of experts);
    None: the SwiGLU `DecoderMLP`."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def keep_hidden_states(self, layer_ids: list[int]):
        """Forward pre-hooks on the layers asked for (and the final norm for id num_layers): each keeps the residual
        stream there, hidden + residual. A model that keeps none has no hook: its forward is unchanged."""
        kept: dict[int, torch.Tensor] = {}
        modules = list(self.model.layers) + [self.model.norm]
        for i in sorted(set(layer_ids)):
            # a layer's args: (positions, hidden, residual); the final norm's: (hidden, residual)
            at = 1 if i < len(self.model.layers) else 0

            def hook(module, args, i=i, at=at):
                hidden, residual = args[at], args[at + 1] if len(args) > at + 1 else None
                kept[i] = hidden if residual is None else (hidden + residual).to(hidden.dtype)  # (float32 stream)

            modules[i].register_forward_pre_hook(hook)
        return lambda: [kept[i] for i in layer_ids]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
