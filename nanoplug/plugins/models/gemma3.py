"""Model `gemma3` (Gemma3ForCausalLM, text). Gemma-3's decoder on the layer library: interleaved local
(sliding-window) and global layers, each kind with its own rope base (and scaling), q/k RMSNorm, four norms per
layer (before and after attention and the MLP), Gemma's (1 + w) RMSNorm, GeGLU (tanh-approximated GELU),
embeddings scaled by sqrt(hidden_size), query_pre_attn_scalar as the softmax scale, and the final logit
soft-capping where the config sets it. Gemma-2 (gemma2.py) is the same decoder without q/k norms, one rope for
every layer, and attention logit soft-capping, which the attention backends apply (AttentionSpec.softcap).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import ModelArchitecture, RotaryEmbedding, Target, residual_stream
from nanoplug.api.config_fields import config_reasons


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32, as transformers' Gemma computes it (the checkpoint stores w)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rounded to `dtype` (the model's, for the float32 residual stream's norms), else to x's."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(dtype or x.dtype)


class _RopeConfig:
    """One layer type's rope base, in the shape `RotaryEmbedding` reads a config."""

    def __init__(self, theta: float):
        self.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        self.partial_rotary_factor = 1.0


ROPE_TYPES = ("default", "linear")  # Gemma-3's: the global layers of the 4B-27B models scale linearly


def rotary_of(params: dict[str, Any], head_dim: int, max_positions: int) -> RotaryEmbedding:
    """One layer type's rotary embedding: its own base, and linear scaling (positions / factor) where set."""
    rotary = RotaryEmbedding(_RopeConfig(params.get("rope_theta", 10000.0)), head_dim, max_positions)
    if params.get("rope_type", "default") == "linear":
        factor = float(params["factor"])
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq / factor)
        emb = torch.cat([freqs, freqs], dim=-1).to(rotary.cos.device)
        rotary.cos.copy_(emb.cos())
        rotary.sin.copy_(emb.sin())
    return rotary


class Gemma3Attention(nn.Module):
    def __init__(self, cfg, layers, attention_factory, layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        heads, kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = layers.qkv(cfg.hidden_size, self.head_dim, heads, kv_heads, bias=bias)
        self.o_proj = layers.row(heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_norm = qk_norm  # Gemma-3's; Gemma-2 has none
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        # backends scale by head_dim ** -0.5; Gemma by query_pre_attn_scalar ** -0.5: q takes the ratio
        self.q_scale = math.sqrt(self.head_dim / cfg.query_pre_attn_scalar)
        self.attn = attention_factory(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        o = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(o.flatten(1))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg, layers):
        super().__init__()
        self.gate_up_proj = layers.merged_column(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = layers.row(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, layers, attention_factory, layer_idx, rotary, qk_norm):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layers, attention_factory, layer_idx, rotary, qk_norm)
        self.mlp = Gemma3MLP(cfg, layers)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, stream: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """stream: the residual stream (float32 for a 16-bit model, `residual_stream`); dtype: the model's."""
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(stream, dtype)))
        return stream + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream, dtype)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg, layers, attention_factory, max_positions: int, per_type_rope: bool, qk_norm: bool):
        super().__init__()
        params, kinds = cfg.rope_parameters, sorted(set(cfg.layer_types))
        if per_type_rope:  # Gemma-3: one rope per layer type
            rotaries = {kind: rotary_of(params[kind], cfg.head_dim, max_positions) for kind in kinds}
        else:  # Gemma-2: one for every layer
            rotaries = dict.fromkeys(kinds, rotary_of(params, cfg.head_dim, max_positions))
        self.rotaries = nn.ModuleList({id(r): r for r in rotaries.values()}.values())  # (so that the platform's fused rope reaches them)
        self.embed_tokens = layers.embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5  # rounded to the model's dtype, as transformers does
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, layers, attention_factory, i, rotaries[kind], qk_norm)
            for i, kind in enumerate(cfg.layer_types)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        dtype = hidden.dtype
        stream = residual_stream(hidden * torch.tensor(self.embed_scale, dtype=dtype))
        for layer in self.layers:
            stream = layer(positions, stream, dtype)
        return self.norm(stream, dtype)


class Gemma3ForCausalLM(nn.Module, ModelArchitecture):
    description = ("Gemma-3 (text): interleaved sliding-window and global layers with their own rope, q/k norm, "
                   "pre/post norms, GeGLU, scaled embeddings")
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    honoured_fields = frozenset({
        "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "attention_bias", "sliding_window", "layer_types",
        "_sliding_window_pattern", "sliding_window_pattern", "query_pre_attn_scalar", "final_logit_softcapping",
    })
    fixed_fields: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
                                    "use_bidirectional_attention": False}
    per_type_rope = True  # rope_parameters holds one dict per layer type (Gemma-2: one dict for every layer)
    qk_norm = True

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        facts = target.model
        if facts is None or facts.config is None:
            return []
        reasons = config_reasons(facts.config, cls.__name__, cls.honoured_fields, cls.fixed_fields)
        params = getattr(facts.config, "rope_parameters", None) or {}
        if not cls.per_type_rope:
            params = dict.fromkeys(set(getattr(facts.config, "layer_types", None) or ()), params)
        kinds = set(getattr(facts.config, "layer_types", None) or ())
        if not kinds <= set(params):
            reasons.append(f"rope_parameters names {sorted(params)}, the layers are {sorted(kinds)}: one per layer type")
        for kind, p in params.items():
            if isinstance(p, dict) and p.get("rope_type", "default") not in ROPE_TYPES:
                reasons.append(f"rope_type {p.get('rope_type')!r} of the {kind} layers is not served (served: "
                               f"{', '.join(ROPE_TYPES)})")
        return reasons

    def __init__(self, hf_config: Any, layers, attention_factory, max_positions: int | None = None):
        super().__init__()
        max_positions = max(max_positions or 0, getattr(hf_config, "max_position_embeddings", 0) or 0, 1)
        self.model = Gemma3Model(hf_config, layers, attention_factory, max_positions, self.per_type_rope, self.qk_norm)
        self.lm_head = layers.lm_head(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
