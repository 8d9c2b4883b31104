"""fp8 e4m3 weights of pre-quantized checkpoints: block-scaled (DeepSeek / Qwen3-FP8: one float32
`weight_scale_inv` per [128, 128] block, w = fp8 * scale_inv, transformers' fine-grained FP8 formula) and
per-channel (compressed-tensors float-quantized: one scale per output row)."""
from __future__ import annotations

import torch


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """The float weight of fp8 `weight` [N, K] and `scale_inv` [ceil(N/bn), ceil(K/bk)]."""
    n, k = weight.shape
    bn, bk = block
    scale = scale_inv.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.to(torch.float32) * scale).to(dtype)


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight of fp8 or int8 `weight` [N, K] and one scale per row `scale` [N]."""
    return (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)
