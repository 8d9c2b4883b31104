"""The decoder-only transformer that Qwen3, Qwen2 and Llama share: RMSNorm, RoPE, grouped-query
attention and a SwiGLU MLP. Model plugins are thin subclasses that set the differences (q/k norm,
q/k/v bias). Parameter names follow Hugging Face checkpoints, so the loader maps them one to one.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.core.attention_layer import PagedAttention
from nanoplug.core.interfaces import ModelArchitecture, Target


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, with the residual add fused in when given."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    fused = None  # set by install_fused_ops: one kernel for norm, and fused_add for add + norm

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps) if residual is None else self.fused_add(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel, same float32 math (CPU hot path)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and scaling for the checkpoint's rope type (llama3, yarn, linear, ...)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        factor = getattr(hf_config, "partial_rotary_factor", 1.0)
        dim = int(head_dim * factor)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the rotate-half form), cos/sin precomputed for every position."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    fused = None  # set by install_fused_ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return (self.fused or apply_rope)(positions, q, k, self.cos, self.sin)


def apply_rope(positions, q, k, cos_table, sin_table):
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(dtype)


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
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1))


class SiluAndMul(nn.Module):
    fused = None  # set by install_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fused or silu_and_mul)(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def install_fused_ops(model: nn.Module, norm, add_norm, act, rope) -> None:
    """Route every RMSNorm, SiLU-and-mul and RoPE of `model` through the given implementations (same
    signatures as rms_norm, add_rms_norm, silu_and_mul and apply_rope)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused, m.fused_add = norm, add_norm
        elif isinstance(m, SiluAndMul):
            m.fused = act
        elif isinstance(m, RotaryEmbedding):
            m.fused = rope


def compile_fused_ops(model: nn.Module) -> None:
    """torch.compile the small elementwise ops (add + RMSNorm, SiLU-and-mul, RoPE) into one kernel
    each: on a GPU each eager op is a launch and a pass over memory. Dynamic shapes, so one compile
    serves every batch; CUDA graphs capture the compiled kernels as they capture eager ones."""
    compile_ = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    install_fused_ops(model, compile_(rms_norm), compile_(add_rms_norm), compile_(silu_and_mul), compile_(apply_rope))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: Any, layers):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = layers.merged_column(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.down_proj = layers.row(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layers, attention_factory, layer_idx, qk_norm, qkv_bias, rotary):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layers, attention_factory, layer_idx, qk_norm, qkv_bias, rotary)
        self.mlp = DecoderMLP(cfg, layers)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, layers, attention_factory, qk_norm, qkv_bias, max_positions):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max_positions)
        self.embed_tokens = layers.embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layers, attention_factory, i, qk_norm, qkv_bias, rotary)
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
    """Base of the model plugins; subclasses set `architectures`, `qk_norm` and `qkv_bias`."""

    qk_norm = False
    qkv_bias = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        return []

    def __init__(self, hf_config: Any, layers, attention_factory, max_positions: int | None = None):
        super().__init__()
        max_positions = max(max_positions or 0, getattr(hf_config, "max_position_embeddings", 0) or 0, 1)
        self.model = DecoderModel(hf_config, layers, attention_factory, self.qk_norm,
                                  self.qkv_bias or getattr(hf_config, "attention_bias", False), max_positions)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = layers.lm_head(hf_config.vocab_size, hf_config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def compile_fused_ops(self) -> None:
        compile_fused_ops(self)

    def install_fused_ops(self, norm, add_norm, act, rope) -> None:
        """Take other implementations of the fused ops (the CPU kernels of nanoplug.cpu_kernels)."""
        install_fused_ops(self, norm, add_norm, act, rope)
