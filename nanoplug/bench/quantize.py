"""Quantized checkpoints written by the libraries that define their formats, from a plain checkpoint:

- compressed-tensors (what llmcompressor saves): `w4a16` / `w4a16_asym` (pack-quantized int4, groups of
  `group_size`), `w8a8` (int-quantized int8 per channel, dynamic per-token int8 activations), `fp8_channel`
  (float-quantized per channel) and `fp8_block_ct` (float-quantized [128, 128] blocks). The scales are
  compressed-tensors' own min-max qparams (`calculate_qparams`; llmcompressor's default observer without
  GPTQ's error feedback), the packing its compressors' (`ModelCompressor.compress_model`).
- `fp8_block`: transformers' fine-grained FP8 layout (`quant_method: "fp8"`, weight_scale_inv per [128, 128]
  block), quantized by transformers' own `Fp8Quantize`.
- `awq`: AutoAWQ's GEMM layout, its own min-max quantizer (`pseudo_quantize_tensor`, without the activation-aware
  scale search) and packer (`WQLinear_GEMM.from_linear`); `gptq`: the same weights in GPTQ's v1 layout through
  AutoAWQ's own conversion to it (`unpack_reorder_pack`, qzeros stored less one).

Used by the tests and by benchmarks/quantize.py (the same files measured against other engines).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

SCHEMES = ("w4a16", "w4a16_asym", "w8a8", "fp8_channel", "fp8_block_ct", "fp8_block", "awq", "gptq")


def _ct_config(scheme: str, group_size: int) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    if scheme.startswith("w4a16"):
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=scheme == "w4a16", strategy="group",
                                   group_size=group_size)
        acts, fmt = None, "pack-quantized"
    elif scheme == "w8a8":
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        fmt = "int-quantized"
    elif scheme == "fp8_channel":
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        fmt = "float-quantized"
    else:
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                                   block_structure=[128, 128])
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=128,
                                dynamic=True)
        fmt = "float-quantized"
    return QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=acts)}, ignore=["lm_head"], format=fmt)


def _qparams(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' min-max scale and zero point for one weight, in its shapes for `args.strategy`."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.float()
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:  # block
        bn, bk = args.block_structure
        b = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    return calculate_qparams(lo, hi, args)


def _write_compressed_tensors(src: Path, dst: Path, scheme: str, group_size: int, dtype: torch.dtype) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
    config = _ct_config(scheme, group_size)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None or qscheme.weights is None:
                continue
            scale, zero = _qparams(module.weight, qscheme.weights)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=config.format)
    compressor.compress_model(model)
    model.save_pretrained(str(dst))
    compressor.update_config(str(dst))


def _write_fp8_block(src: Path, dst: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    qconfig = FineGrainedFP8Config(weight_block_size=[128, 128])
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": qconfig})())
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.glob("*.safetensors"):
        out = {}
        for name, t in load_file(str(file)).items():
            quantized = "layers." in name and name.endswith("proj.weight")  # linear layers; not embeddings, head
            out.update(quantize._quantize_one(name, t.to(dtype)) if quantized else {name: t.to(dtype)})
        save_file({k: v.contiguous() for k, v in out.items()}, str(dst / file.name), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def _write_awq(src: Path, dst: Path, scheme: str, group_size: int) -> None:
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import unpack_reorder_pack
    from safetensors.torch import load_file, save_file

    quantizer = type("Quantizer", (), {"w_bit": 4, "group_size": group_size, "zero_point": True})()
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.glob("*.safetensors"):
        out = {}
        for name, t in load_file(str(file)).items():
            if not ("layers." in name and name.endswith("proj.weight")):
                out[name] = t.to(torch.float16)
                continue
            w, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(quantizer, t.float())
            linear = torch.nn.Linear(t.shape[1], t.shape[0], bias=False)
            linear.weight.data = w
            q = WQLinear_GEMM.from_linear(linear, 4, group_size, False, scales.t().contiguous(), zeros.t().contiguous())
            qweight, qzeros = q.qweight, q.qzeros
            if scheme == "gptq":
                qweight, qzeros = unpack_reorder_pack(qweight, qzeros, 4)
            module = name.removesuffix(".weight")
            out.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": q.scales})
        save_file({k: v.contiguous() for k, v in out.items()}, str(dst / file.name), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                   "version": "gemm"} if scheme == "awq" else
                                  {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                                   "sym": False, "checkpoint_format": "gptq"})
    cfg["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def write_quantized_checkpoint(src: str | Path, dst: str | Path, scheme: str, group_size: int = 128,
                               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `src` (a plain checkpoint) quantized by `scheme` (one of SCHEMES) into `dst`, with its tokenizer."""
    src, dst = Path(src), Path(dst)
    if (dst / "config.json").is_file():
        return dst
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    if scheme == "fp8_block":
        _write_fp8_block(src, dst, dtype)
    elif scheme in ("awq", "gptq"):
        _write_awq(src, dst, scheme, group_size)
    else:
        _write_compressed_tensors(src, dst, scheme, group_size, dtype)
    for f in src.iterdir():  # the tokenizer and generation config
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",) \
                and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst
