"""Weight format `int8_rows`: linear weights quantized on load to int8, one float scale per output row.

Written only against `nanoplug.api`: a `WeightFormat` that gives a `LinearMethod`. Each linear layer's
weight becomes int8 [out, in] with scales [out] (w ~= q * scale, |q| <= 127, rounded to nearest); the
product is `F.linear(x, q) * scale`, with activations left as they are. The embedding stays dense (and a
tied LM head with it). A quarter of float32's bytes for the linear weights, at about 0.5% of each weight's
row maximum as the largest rounding error.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import DenseLinearMethod, LinearMethod, Target, WeightFormat, check_shape, hookimpl

NANOPLUG_API_VERSION = 3  # the plugin API this module was written for; the registry refuses others

INT8_MAX = 127


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [rows, cols] and float32 scales [rows] with w ~= values * scales[:, None]."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


class Int8RowsMethod(LinearMethod):
    """Linear layers: `weight` int8 [out, in] and `weight_scale` [out]; the embedding (and a tied head) dense."""

    def __init__(self):
        self.dense = DenseLinearMethod()

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        if layer.role == "embedding":
            return self.dense.create_weights(layer, input_size, output_size, dtype)
        layer.register_parameter("weight", nn.Parameter(torch.empty(output_size, input_size, dtype=torch.int8),
                                                        requires_grad=False))
        layer.register_buffer("weight_scale", torch.ones(output_size, dtype=dtype), persistent=False)

    def load(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, out_offset: int, out_size: int) -> None:
        if param.dtype != torch.int8:
            return self.dense.load(layer, param, tensor, out_offset, out_size)
        check_shape(tensor, (out_size, param.shape[1]), type(layer).__name__)
        q, scale = quantize_rows(tensor.to(param.device))
        param.data[out_offset:out_offset + out_size] = q
        layer.weight_scale[out_offset:out_offset + out_size] = scale.to(layer.weight_scale.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.dtype != torch.int8:
            return self.dense.apply(layer, x, bias)
        y = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale
        return y + bias if bias is not None else y

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return self.dense.embed(layer, ids)


class Int8RowsFormat(WeightFormat):
    description = "linear weights quantized on load to int8, one scale per output row (example third-party plugin)"
    quantizes = True  # changes the weights: chosen by name only (quantization="int8_rows")

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if target.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return [f"dtype {target.dtype} unsupported; use float32, float16 or bfloat16"]
        return []

    def linear_method(self) -> LinearMethod:
        return Int8RowsMethod()


@hookimpl
def nanoplug_register_weight_format(register) -> None:
    register.add("int8_rows", Int8RowsFormat)
