"""RMSNorm, computed in float32, with the residual add fused in when given.

A 16-bit model keeps its residual stream in float32 (`residual_stream`): rounding the running sum to 8 bits of
mantissa after every layer was, with the logits' rounding, the largest part of bf16's drift from float32
(benchmarks/RESULTS.md, Quality). Each layer still reads and writes 16-bit activations; only the sum and the
norm's input are wider."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in float32, rounded to x's dtype, times the weight (transformers' order of roundings); a float32
    x with a 16-bit weight (a 16-bit model's residual stream) is rounded once, to the weight's dtype."""
    if x.dtype == torch.float32:
        if weight.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel, same float32 math (CPU hot path)
        return F.rms_norm(x, weight.shape, weight.float(), eps).to(weight.dtype)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def residual_stream(hidden: torch.Tensor) -> torch.Tensor:
    """The residual stream a decoder starts from its embeddings: float32 for a 16-bit model, else itself."""
    return hidden.float() if hidden.dtype in (torch.bfloat16, torch.float16) else hidden


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual). With a float32 residual and a 16-bit x (`residual_stream`), the
    sum stays float32 and its norm is rounded once, to the weight's dtype (the model's, x's)."""
    residual = x + residual  # (a 16-bit x and a float32 residual add in float32)
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """`rms_norm(x)`, or with a residual `(rms_norm(x + residual), x + residual)`."""

    fused = None  # set by install_fused_ops: one kernel for norm, and fused_add for add + norm
    fused_add = None

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps) if residual is None else self.fused_add(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
