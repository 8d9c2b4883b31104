"""Weight format `fp8_checkpoint`: fp8 checkpoints (`quant_method: "fp8"`): e4m3 weights with one float32
`weight_scale_inv` per `weight_block_size` block ([128, 128]: DeepSeek-V3, Qwen3-FP8), or one `weight_scale`
per tensor, kept in fp8. Each dequantized weight is transformers' fine-grained FP8 formula (w * scale_inv per
block). Static activation scales are refused (nanoplug quantizes activations dynamically)."""
from __future__ import annotations

import torch

from nanoplug.plugins.weight_formats.prequantized import FP8, PrequantizedFormat, QuantizedWeight


class FP8CheckpointFormat(PrequantizedFormat):
    description = ("fp8 checkpoints (block-scaled weight_scale_inv, or per-tensor weight_scale), kept in fp8 (Triton "
                   "block-scaled fp8 GEMM on sm89+)")
    quant_method = "fp8"
    suffixes = ("weight_scale_inv", "weight_scale")

    @classmethod
    def unavailable(cls, target):
        return ([] if FP8 is not None else ["this torch has no float8_e4m3fn dtype"]) + super().unavailable(target)

    def refuses(self) -> str | None:
        q = self.qconfig
        if q.get("activation_scheme", "dynamic") != "dynamic":
            return (f"its activation_scheme is {q.get('activation_scheme')!r}; nanoplug serves 'dynamic' (per-token "
                    "scales computed on each call)")
        if q.get("fmt", "e4m3") != "e4m3":
            return f"its fp8 format {q.get('fmt')!r} is not served (e4m3 is)"
        self.block = tuple(q["weight_block_size"]) if q.get("weight_block_size") else None
        return None

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix in self.suffixes or (suffix == "weight" and tensor.dtype == FP8)

    def complete(self, parts: dict[str, torch.Tensor]) -> bool:
        return "weight" in parts and ("weight_scale_inv" in parts or "weight_scale" in parts)

    def convert(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        w = parts["weight"]
        if "weight_scale_inv" in parts:
            if self.block is None:
                raise ValueError("it has weight_scale_inv but the config has no weight_block_size")
            n, k = w.shape
            scales = parts["weight_scale_inv"]
            if list(scales.shape) != [-(-n // self.block[0]), -(-k // self.block[1])]:
                raise ValueError(f"its weight_scale_inv {list(scales.shape)} does not fit {self.block} blocks of {[n, k]}")
            return QuantizedWeight("fp8_block", w.shape, {"qweight": w, "scales": scales}, self.block)
        return QuantizedWeight("fp8", w.shape, {"qweight": w, "scales": parts["weight_scale"]})
