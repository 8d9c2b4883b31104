"""Weight format `compressed_tensors`: checkpoints as llmcompressor / compressed-tensors write them
(`quant_method: "compressed-tensors"`), kept quantized:

- `pack-quantized` int4 weight-only (W4A16): groups or channels, symmetric or asymmetric (packed zero
  points), with or without activation order (`weight_g_idx`);
- `int-quantized` int8 (W8A8, dynamic per-token activations) and `float-quantized` fp8 (per channel,
  per tensor, or [128, 128] blocks).

Each dequantized weight equals compressed-tensors' own decompressor's (tests/test_quant_checkpoints.py).
What this cannot serve (other bit widths, static activation scales, a quantized KV cache, sparsity,
transforms) is refused at start-up with the reason.
"""
from __future__ import annotations

from typing import Any

import torch

from nanoplug.kernels.quant import int4
from nanoplug.plugins.weight_formats.prequantized import FP8, PrequantizedFormat, QuantizedWeight

SERVED = "pack-quantized int4 (W4A16), int-quantized int8 (W8A8), float-quantized fp8"


class CompressedTensorsFormat(PrequantizedFormat):
    description = ("compressed-tensors checkpoints (llmcompressor), kept quantized: int4 W4A16 groups (Triton on CUDA, C++ "
                   "on CPU), int8 W8A8 (torch._int_mm, C++), fp8 per channel or in blocks (sm89+)")
    quant_method = "compressed-tensors"
    suffixes = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")

    def _groups(self) -> list[dict[str, Any]]:
        return list((self.qconfig.get("config_groups") or {}).values())

    def refuses(self) -> str | None:
        q = self.qconfig
        if q.get("quantization_status", "compressed") != "compressed":
            return (f"its weights are stored {q.get('quantization_status')!r}, not compressed; save it with "
                    "llmcompressor's save_compressed=True")
        if q.get("kv_cache_scheme"):
            return "it quantizes the KV cache (kv_cache_scheme), which nanoplug does not read; drop kv_cache_scheme"
        if q.get("sparsity_config") and (q["sparsity_config"].get("format") not in (None, "dense")):
            return f"its sparsity format {q['sparsity_config'].get('format')!r} is not served ({SERVED} are)"
        if q.get("transform_config"):
            return "it carries transforms (transform_config, e.g. SpinQuant/QuIP rotations), which nanoplug does not apply"
        groups = self._groups()
        if not groups:
            return "its quantization_config has no config_groups"
        self.schemes, self.acts = set(), {}
        for group in groups:
            fmt = group.get("format") or q.get("format")
            w, a = group.get("weights") or {}, group.get("input_activations")
            why = self._scheme_refused(fmt, w, a)
            if why:
                return f"{why} (config group targets {group.get('targets')}); nanoplug serves {SERVED}"
            self.schemes.add((fmt, w.get("symmetric", True), w.get("actorder")))
            kind = w.get("type", "int")
            act = None if a is None else (a.get("type", "int"), a.get("group_size") if a.get("strategy") == "group" else None)
            if self.acts.setdefault(kind, act) != act:
                return f"its {kind} config groups quantize activations differently ({self.acts[kind]} and {act})"
        packed = {s for s in self.schemes if s[0] == "pack-quantized"}
        if len(packed) > 1:
            return "its int4 config groups differ in symmetry or activation order, which nanoplug serves one at a time"
        self.asymmetric = any(not s[1] for s in packed)
        self.g_idx = any(s[2] == "group" for s in packed)
        return None

    @staticmethod
    def _scheme_refused(fmt: str | None, w: dict, a: dict | None) -> str | None:
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        if a is not None and not a.get("dynamic", False):
            return "its activations have static scales (input_scale); nanoplug quantizes activations dynamically only"
        if fmt == "pack-quantized":
            if kind != "int" or bits != 4 or strategy not in ("group", "channel") or a is not None:
                return f"pack-quantized {kind}{bits} {strategy} weights (with activations {a}) are not served"
            return None
        if fmt in ("int-quantized", "naive-quantized") and kind == "int":
            if bits != 8 or not w.get("symmetric", True) or strategy not in ("channel", "tensor"):
                return f"int-quantized int{bits} {strategy} {'symmetric' if w.get('symmetric', True) else 'asymmetric'} weights are not served"
            if a is not None and (a.get("type", "int") != "int" or a.get("strategy") != "token"):
                return f"int8 weights with {a.get('type')} {a.get('strategy')} activations are not served"
            return None
        if fmt in ("float-quantized", "naive-quantized") and kind == "float":
            if bits != 8 or strategy not in ("channel", "tensor", "block"):
                return f"float-quantized fp{bits} {strategy} weights are not served"
            if a is not None and (a.get("type", "float") != "float" or a.get("strategy") not in ("token", "group")):
                return f"fp8 weights with {a.get('type')} {a.get('strategy')} activations are not served"
            if strategy == "block" and not w.get("block_structure"):
                return "block-scaled fp8 weights without a block_structure are not served"
            return None
        return f"the {fmt!r} format ({kind}{bits} weights) is not served"

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        if suffix == "weight":
            return tensor.dtype in (torch.int8, FP8)
        return suffix in self.suffixes

    def complete(self, parts: dict[str, torch.Tensor]) -> bool:
        if "weight_packed" in parts:
            need = {"weight_scale", "weight_shape"} | ({"weight_zero_point"} if self.asymmetric else set()) \
                | ({"weight_g_idx"} if self.g_idx else set())
            return need <= parts.keys()
        return "weight" in parts and "weight_scale" in parts

    def convert(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        if "weight_packed" not in parts:
            w, scale = parts["weight"], parts["weight_scale"]
            n, k = w.shape
            if scale.dim() == 2 and scale.shape[0] != n:  # [N/bn, K/bk]: blocks
                bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
                return QuantizedWeight("fp8_block", w.shape, {"qweight": w, "scales": scale}, (bn, bk), self.acts["float"])
            kind = "int" if w.dtype == torch.int8 else "float"
            return QuantizedWeight("int8" if kind == "int" else "fp8", w.shape, {"qweight": w, "scales": scale},
                                   act=self.acts.get(kind))
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        if k % 8:
            raise ValueError(f"its {k} input columns are not a multiple of 8")
        q = int4.unpack_int4(parts["weight_packed"])[:, :k]
        scales = parts["weight_scale"]
        zeros = parts.get("weight_zero_point")
        if zeros is not None:
            zeros = int4.unpack_int4(zeros, dim=0)[:n]
        group_size = k // scales.shape[1]
        perm = None
        if parts.get("weight_g_idx") is not None:
            perm = int4.sort_by_group(parts["weight_g_idx"], group_size)
            if perm is not None:
                q = q[:, perm]
        return QuantizedWeight("int4", torch.Size((n, k)),
                               {"qweight": int4.pack_int4(q), "scales": scales, "zeros": zeros, "perm": perm})
