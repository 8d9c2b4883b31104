"""PyTorch's own int4 kernel for the decode rows of W4A16 layers: `torch._weight_int4pack_mm` ("tinygemm", the
kernel behind gpt-fast's and torchao's int4 weight-only linears; mma tiles fed by registers). At 1-4 rows it reads
the weights faster than the Triton GEMV (benchmarks/studies/gpu_int4_tinygemm.py), at more rows it is slower than
w4a16_gemm, so a layer that takes it keeps both layouts: this one for decode, int4.py's for batches.

Its weight is (q - 8) * scale + zero in bfloat16 per group; with zero 0 (a symmetric checkpoint) and bfloat16 scales
that is the value `dequantize_int4(..., torch.bfloat16)` gives, and the products are summed in float32 on tensor
cores, so it equals the dequantized matmul within float32 rounding (tests/gpu/test_gpu_w4a16.py).
"""
from __future__ import annotations

import torch

from nanoplug.kernels.quant import int4

ROWS = 4  # up to this many rows take it
INNER_K_TILES = 8  # the packing's K tiles a word-group (8: the fastest of 2, 4, 8 at one row on the 8B shape)
GROUP_SIZES = (32, 64, 128, 256)


def unavailable(device: torch.device, n: int, k: int, group_size: int, symmetric: bool, dtype: torch.dtype,
                scales: torch.Tensor) -> str | None:
    """Why tinygemm cannot serve this layer (None: it can)."""
    if device.type != "cuda":
        return f"it runs on CUDA only (the layer is on {device.type})"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return "this torch has no torch._weight_int4pack_mm"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "it needs compute capability 8.0 or later"
    if dtype != torch.bfloat16:
        return f"it takes bfloat16 activations (the model computes in {dtype})"
    if not symmetric:
        return "its zero is a bfloat16 offset, which rounds an asymmetric checkpoint's (q - zero) * scale"
    if group_size not in GROUP_SIZES:
        return f"its groups are {GROUP_SIZES}, not {group_size}"
    if n % 8 or k % (INNER_K_TILES * 16):
        return f"it needs rows a multiple of 8 and columns of {INNER_K_TILES * 16} (the layer is [{n}, {k}])"
    if not torch.equal(scales.to(torch.bfloat16).to(scales.dtype), scales):
        return f"its scales ({scales.dtype}) are not all bfloat16 values"
    return None


def pack(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4.py's symmetric layout as tinygemm's operands: the weight (two values a byte, the even column in the
    high nibble, then the kernel's tiling) and [K / group, N, 2] (scale, zero 0) in bfloat16."""
    q = int4.unpack_int4(qweight).to(torch.int32)
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    del q
    scale = scales.t().to(torch.bfloat16)
    return (torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), INNER_K_TILES),
            torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous())


def matmul(x2: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x2 [M, K] bfloat16 (rows contiguous) @ W.T -> [M, N] bfloat16."""
    return torch.ops.aten._weight_int4pack_mm(x2, packed, group_size, scales_and_zeros)
