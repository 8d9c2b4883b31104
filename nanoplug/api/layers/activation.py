"""SiLU-and-mul, the gated activation of SwiGLU MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]`."""

    fused = None  # set by install_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fused or silu_and_mul)(x)
