"""Random checkpoints written directly in a quantized format, tensor by tensor, without a bf16 model first: at the
8B shape, quantizing 16 GB of bf16 through transformers takes minutes, drawing the packed tensors takes seconds.

- compressed-tensors, as llmcompressor saves (scales in the model's dtype): `w4a16`, pack-quantized int4 in
  symmetric groups of 128 (the W4A16 preset: `weight_packed` int32 [N, K/8], `weight_scale` [N, K/128],
  `weight_shape` int64 [2]); `w8a8`, int-quantized int8 per channel with dynamic per-token int8 activations
  (`weight` int8, `weight_scale` [N, 1]); `fp8_block_ct`, float-quantized e4m3 in [128, 128] blocks with dynamic
  per-token-group activations (`weight`, `weight_scale` [N/128, K/128]); each with the quantization_config
  compressed-tensors writes (so the files need no compressed-tensors to write: the GPU machine has none);
- `fp8_block`: transformers' fine-grained FP8 (`quant_method: "fp8"`, e4m3 `weight` and float32
  `weight_scale_inv` per [128, 128] block), the layout of Qwen3-8B-FP8 and DeepSeek-V3;
- `bf16`: the plain checkpoint.

The embedding, norms and LM head stay in the model's dtype (both libraries leave them). Weights are drawn so
the dequantized values have about transformers' initializer spread (0.02). tests/test_random_quantized.py
checks, on a tiny model, that each file has the tensors, dtypes, shapes and config the libraries themselves
write, and that their own dequantization reads it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nanoplug.bench.checkpoints import (SHARD_BYTES, TINY_SHAPE, _checkpoint_tensors, _hf_classes, _write_shard,
                                        qwen_tokenizer_dir)

SCHEMES = ("bf16", "w4a16", "w8a8", "fp8_block", "fp8_block_ct")
GROUP, BLOCK = 128, (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
CT_VERSION = "0.20.1"  # the compressed-tensors whose config these reproduce (its `version` field)


def _ct_args(type_: str, strategy: str, num_bits: int = 8, group_size: int | None = None, dynamic: bool = False,
             block_structure: list[int] | None = None) -> dict[str, Any]:
    """One QuantizationArgs as compressed-tensors serializes it."""
    args = {"dynamic": dynamic, "group_size": group_size, "num_bits": num_bits, "strategy": strategy,
            "symmetric": True, "type": type_}
    return {**args, "block_structure": block_structure} if block_structure else args


def ct_quantization_config(scheme: str) -> dict[str, Any]:
    """The quantization_config compressed-tensors' ModelCompressor writes for `scheme` (the presets of
    nanoplug/bench/quantize.py; tests/test_random_quantized.py compares the two)."""
    fmt, weights, acts = {
        "w4a16": ("pack-quantized", _ct_args("int", "group", 4, GROUP), None),
        "w8a8": ("int-quantized", _ct_args("int", "channel"), _ct_args("int", "token", dynamic=True)),
        "fp8_block_ct": ("float-quantized", _ct_args("float", "block", block_structure=list(BLOCK)),
                         _ct_args("float", "group", group_size=BLOCK[1], dynamic=True)),
    }[scheme]
    group = {"format": fmt, "input_activations": acts, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "moe_sparsity_config": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION}


def _linear(name: str) -> bool:
    return "layers." in name and name.endswith("proj.weight")


def _quantized(name: str, dims: tuple[int, ...], scheme: str, dtype: torch.dtype, std: float,
               gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    module = name.removesuffix(".weight")
    n, k = dims
    if scheme == "w4a16":
        # q - 8 uniform in [-8, 7] has a spread of ~4.6: scales around std / 4.6
        packed = torch.randint(-2 ** 31, 2 ** 31, (n, k // 8), generator=gen, dtype=torch.int32, device=device)
        scale = torch.empty(n, k // GROUP, device=device).uniform_(0.5, 1.5, generator=gen) * (std / 4.6)
        return {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale.to(dtype),
                f"{module}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if scheme == "w8a8":  # int8 uniform in [-127, 127]: a spread of ~73
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8, device=device)
        scale = torch.empty(n, 1, device=device).uniform_(0.5, 1.5, generator=gen) * (std / 73)
        return {f"{module}.weight": w, f"{module}.weight_scale": scale.to(dtype)}
    w = (torch.randn(n, k, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.empty(-(-n // BLOCK[0]), -(-k // BLOCK[1]), device=device).uniform_(0.5, 1.5, generator=gen)
    scale = scale * (std / 64)
    if scheme == "fp8_block_ct":
        return {f"{module}.weight": w, f"{module}.weight_scale": scale.to(dtype)}
    return {f"{module}.weight": w, f"{module}.weight_scale_inv": scale}


def write_random_quantized(folder: str | Path, scheme: str, seed: int = 0, dtype: Any = None, device: str = "cpu",
                           **shape: Any) -> Path:
    """A seeded random Qwen3-family checkpoint of `shape` (tiny by default) in `scheme`, sharded as
    save_pretrained shards (about 4 GiB each), with config and the Qwen3 tokenizer; drawn on `device`."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or torch.bfloat16
    architecture = shape.pop("architecture", "Qwen3ForCausalLM")
    config_cls, model_cls = _hf_classes(architecture)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    config = config_cls(**{**TINY_SHAPE, "bos_token_id": None, "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
                           "pad_token_id": tok.pad_token_id, "vocab_size": len(tok), **shape})
    with torch.device("meta"):
        model = model_cls(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, dims in _checkpoint_tensors(model):
        if scheme != "bf16" and _linear(name):
            tensors = _quantized(name, dims, scheme, dtype, std, gen, device)
        elif "norm" in name:
            tensors = {name: torch.empty(dims, device=device).uniform_(0.5, 1.5, generator=gen).to(dtype)}
        else:
            tensors = {name: (torch.randn(dims, generator=gen, device=device) * std).to(dtype)}
        for t_name, t in tensors.items():
            t = t.cpu().contiguous()
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > SHARD_BYTES:
                shards.append(_write_shard(folder, len(shards) + 1, current, save_file))
                current, size = {}, 0
            current[t_name] = t
            size += nbytes
    if current:
        shards.append(_write_shard(folder, len(shards) + 1, current, save_file))
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    if len(names) == 1:
        names = ["model.safetensors"]
    weight_map = {}
    for i, (tensor_names, name) in enumerate(zip(shards, names), start=1):
        (folder / f"shard-{i}.safetensors").rename(folder / name)
        weight_map.update({t: name for t in tensor_names})
    if len(names) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.architectures = [architecture]
    config.dtype = dtype
    config.save_pretrained(str(folder))
    if scheme != "bf16":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = dict(FP8_CONFIG) if scheme == "fp8_block" else ct_quantization_config(scheme)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(folder))
    return folder
