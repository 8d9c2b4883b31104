"""Dynamic activation quantization as compressed-tensors defines it for W8A8 checkpoints (symmetric, per
token or per token-group of K columns): x -> q * scale with scale = amax|x| / (range / 2), q rounded to int8
or cast to fp8 e4m3. Applied before a matmul with the dequantized weight, it computes what an int8 / fp8
GEMM with those scales computes, up to float rounding; `quantize` hands the int8 GEMMs (torch._int_mm on
CUDA, the C++ kernel on CPU) the same q and scales."""
from __future__ import annotations

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0


def quantize(x: torch.Tensor, kind: str, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [..., K] -> (q, scale): q [..., K] (float values of int8 or e4m3 in x's dtype), scale [..., 1] per
    row (or [..., K/group, 1] per `group` columns, q then [..., K/group, group]), in x's dtype."""
    if group is not None:
        x = x.unflatten(-1, (-1, group))
    amax = x.abs().amax(-1, keepdim=True)
    half_range = torch.tensor(127.5 if kind == "int" else FP8_MAX, dtype=x.dtype, device=x.device)
    scale = amax / half_range
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype, device=x.device), scale)
    if kind == "int":
        q = torch.clamp(torch.round(x / scale), -128, 127)
    else:
        q = torch.clamp(x / scale, -FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)
    return q, scale


def fake_quantize(x: torch.Tensor, kind: str, group: int | None = None) -> torch.Tensor:
    """`x` [..., K] quantized and dequantized per row (or per `group` columns of a row); kind: int | float."""
    q, scale = quantize(x, kind, group)
    return (q * scale).reshape(x.shape)
