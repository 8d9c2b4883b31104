"""What the per-request LoRA kernel tests build on (tests/test_lora_kernels.py on CPU,
tests/gpu/test_gpu_lora_kernels.py on CUDA): one adapted layer with factors stacked as multi_lora.py stacks them, a float64 per-token reference,
and PEFT-format LoRA folders written without PEFT (the GPU machine need not have it).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from nanoplug.plugins.adapters.lora.per_request import MaskedSlots, MultiLoraLinear, TiledSlots


class Base(nn.Module):
    """A stand-in for the base linear layer: one rank, no bias."""

    reduces = False

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.group, self.weight = None, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def stacked(sizes: list[int], adapted: list[int], ranks: tuple[int, ...], in_features: int, seed: int = 0):
    """Random float32 factors laid out as multi_lora.py stacks them: A [S*K*R, in], B [out, S*K*R] (each
    slice's B only in its own rows, ranks zero-padded to the largest), and the rows of each adapted slice."""
    gen = torch.Generator().manual_seed(seed)
    s_, k_, r_ = len(sizes), len(ranks), max(ranks)
    a = torch.zeros(s_, k_, r_, in_features)
    b = torch.zeros(sum(sizes), s_, k_, r_)
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    for s in adapted:
        for k, r in enumerate(ranks):
            a[s, k, :r] = torch.randn(r, in_features, generator=gen) / in_features ** 0.5
            b[offsets[s]:offsets[s] + sizes[s], s, k, :r] = torch.randn(sizes[s], r, generator=gen)
    return a.reshape(-1, in_features), b.reshape(sum(sizes), -1), {s: (offsets[s], sizes[s]) for s in adapted}


def adapted_layer(sizes: list[int], adapted: list[int], ranks: tuple[int, ...], in_features: int, use_kernels: bool,
                  max_tokens: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A MultiLoraLinear over a random base, on the kernels or the masked path, and its slices' rows."""
    a, b, rows = stacked(sizes, adapted, ranks, in_features, seed)
    weight = torch.randn(sum(sizes), in_features, generator=torch.Generator().manual_seed(seed + 1))
    dev = torch.device(device)
    slots = (TiledSlots if use_kernels else MaskedSlots)(len(ranks), max(ranks), dtype, dev, max_tokens)
    layer = MultiLoraLinear(Base(weight.to(dev, dtype)), slots, a.to(dev, dtype), b.to(dev, dtype), len(sizes), rows)
    return layer, rows


def reference(x: torch.Tensor, layer: MultiLoraLinear, ids: torch.Tensor, rows: dict[int, tuple[int, int]],
              num_adapters: int, rank: int) -> torch.Tensor:
    """Each token's own adapter, one slice at a time, in float64 on the CPU: the update to add to the base output."""
    s_ = layer.num_slices
    a4 = layer.lora_a.double().cpu().view(s_, num_adapters, rank, -1)
    b4 = layer.lora_b.double().cpu().view(-1, s_, num_adapters, rank)
    x = x.double().cpu()
    out = torch.zeros(x.shape[0], b4.shape[0], dtype=torch.float64)
    for t, i in enumerate(ids.tolist()):
        if i:
            for s, (offset, size) in rows.items():
                h = a4[s, i - 1] @ x[t]
                out[t, offset:offset + size] += b4[offset:offset + size, s, i - 1] @ h
    return out


def mixed_ids(num_tokens: int, num_adapters: int, seed: int = 0) -> torch.Tensor:
    """Adapter ids (0: none) of `num_tokens` tokens: a fifth without one, 40% on adapter 2 (several tiles)."""
    rng = np.random.default_rng(seed)
    p = np.full(num_adapters + 1, 0.4 / (num_adapters - 1))
    p[0], p[2] = 0.2, 0.4
    ids = torch.from_numpy(rng.choice(num_adapters + 1, size=num_tokens, p=p / p.sum()).astype(np.int64))
    if not ids.any():
        ids[0] = 2
    return ids


def poison_unused(layer: MultiLoraLinear, ids: torch.Tensor, num_adapters: int, rank: int) -> None:
    """NaN into the factors of every adapter no token of `ids` uses."""
    unused = [k for k in range(num_adapters) if not (ids == k + 1).any()]
    s_ = layer.num_slices
    layer.lora_a.view(s_, num_adapters, rank, -1)[:, unused] = float("nan")
    layer.lora_b.view(-1, s_, num_adapters, rank)[:, :, unused] = float("nan")


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora(folder: Path, config, seed: int, rank: int = 16) -> str:
    """A random PEFT-format LoRA (alpha 2 * rank) on all seven projections of every layer of a model of `config`."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q_proj": (hidden, heads), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (heads, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                    target_modules=list(PROJECTIONS), bias="none")
    (folder / "adapter_config.json").write_text(json.dumps(settings, indent=1))
    return str(folder)
