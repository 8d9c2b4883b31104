"""Weight format `fp8`: linear weights quantized on load to float8 e4m3 with one float32 scale per output row
(`LLM(path, quantization="fp8")` on a bfloat16 or float32 checkpoint): half of bfloat16's bytes.

On a GPU that multiplies fp8 (compute capability 8.9 and later: Ada, Hopper) each call quantizes its
activations per row (token) to e4m3 and runs `torch._scaled_mm` with the row-wise scales (activation
scale per row, weight scale per column of the output; bfloat16 out), as vLLM's per-token fp8 path does.
Where that kernel is missing or refuses the shapes, and on every other device, the reference path
multiplies the dequantized weight with F.linear: same weights, activations unquantized. The embedding
and the LM head stay in the model's dtype (as in vLLM's fp8 checkpoints). A mixture-of-experts model's experts
are quantized the same way and kept stacked (`ExpertRows`): the fused MoE kernels read the e4m3 values and scale
each output row, activations unquantized.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import DenseLinearMethod, ExpertRows, LinearMethod, Target, WeightFormat, check_shape

log = logging.getLogger("nanoplug")
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1e-12  # a row of zeros keeps a positive scale (and quantizes to zeros)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 values [..., rows, cols] and float32 scales [..., rows] with w ~= values * scales[..., None]
    (a layer's weight, or an MoE's stacked experts, each row its own scale)."""
    w = w.float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def scaled_mm_reasons(device: torch.device) -> list[str]:
    """Why torch._scaled_mm's fp8 path cannot run on `device` (empty: it can)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return [f"torch._scaled_mm's fp8 GEMM needs CUDA (device is {device.type})"]
    if not hasattr(torch, "_scaled_mm"):
        return ["this torch has no torch._scaled_mm"]
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return [f"fp8 GEMMs need compute capability 8.9 or later (this GPU is {major}.{minor})"]
    return []


class FP8Format(WeightFormat):
    quantizes = True  # by name only: quantization="fp8"
    description = ("linear weights quantized on load to fp8 e4m3, per-output-channel scales (torch._scaled_mm "
                   "with per-token activation scales on sm89+, dequantize + F.linear elsewhere)")

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if FP8 is None:
            return ["this torch has no float8_e4m3fn dtype (torch 2.1 or later)"]
        return []

    def linear_method(self) -> LinearMethod:
        return FP8LinearMethod()


class FP8LinearMethod(LinearMethod):
    """Linear layers: `weight` float8 [out, in] and `weight_scale` float32 [out]; embedding and LM head dense."""

    def __init__(self):
        self.dense = DenseLinearMethod()
        self.rowwise: bool | None = None  # whether _scaled_mm's row-wise scaling runs here (tried on first use)
        # an MoE's experts: the same per-row e4m3 values, stacked for the fused MoE kernels (weight-only: the
        # activations stay in the model's dtype there)
        self.expert_rows = ExpertRows(FP8, quantize_rows)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        if layer.role != "linear":
            return self.dense.create_weights(layer, input_size, output_size, dtype)
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8), requires_grad=False)
        layer.register_parameter("weight", weight)
        layer.register_buffer("weight_scale", torch.ones(output_size, dtype=torch.float32), persistent=False)
        layer.fp8_gemm = input_size % 16 == 0 and output_size % 16 == 0  # what _scaled_mm's shapes need

    def load(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, out_offset: int, out_size: int) -> None:
        if layer.role != "linear":
            return self.dense.load(layer, param, tensor, out_offset, out_size)
        check_shape(tensor, (out_size, param.shape[1]), type(layer).__name__)
        q, scale = quantize_rows(tensor.to(param.device))
        param.data[out_offset:out_offset + out_size] = q
        layer.weight_scale[out_offset:out_offset + out_size] = scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.role != "linear":
            return self.dense.apply(layer, x, bias)
        if self.rowwise is None:
            self.rowwise = not scaled_mm_reasons(x.device) and layer.fp8_gemm and self._try_rowwise(layer, x)
        if self.rowwise and layer.fp8_gemm:
            return self.scaled_mm(layer, x, bias)
        return F.linear(x, dequantize_rows(layer.weight, layer.weight_scale, x.dtype), bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return self.dense.embed(layer, ids)

    @staticmethod
    def scaled_mm(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x quantized per row to e4m3 (dynamic scales), one row-wise scaled fp8 GEMM, bfloat16 out."""
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)  # [M, 1]
        xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                               bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16)
        return out.to(x.dtype).view(*x.shape[:-1], -1)

    def _try_rowwise(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether this torch's _scaled_mm takes row-wise scales here (decided once, eagerly, at warm-up)."""
        try:
            self.scaled_mm(layer, x[..., :1, :].contiguous() if x.dim() > 1 else x, None)
            return True
        except (RuntimeError, TypeError, ValueError) as exc:
            log.warning("fp8 weights: torch._scaled_mm with row-wise scales does not run here (%s); "
                        "multiplying dequantized weights instead", exc)
            return False
