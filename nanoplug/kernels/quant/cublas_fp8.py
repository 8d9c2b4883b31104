"""cuBLAS's block-scaled fp8 GEMM for prefill batches of block-scaled checkpoints (torch.nn.functional.scaled_mm
on SM90: activations per token and group of 128 columns, `BlockWise1x128`, times weights per [128, 128] block,
`BlockWise128x128`: the DeepSeek-V3 recipe the checkpoints carry). The activations are quantized as the Triton
GEMM's are (triton_fp8.group_quant, scale = amax / 448), so both compute the same sum; cuBLAS's pipeline runs it
at the fp8 tensor cores' rate (benchmarks/studies/gpu_fp8_scaled_mm.py). Decode rows keep the Triton GEMV.

cuBLAS reads the activations' scales token-major with a leading dimension that is a multiple of 4 (rows are
padded to one, quantized as zeros, not copied) and the weights' scales with their K blocks padded to a multiple of 4 (made once per layer)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nanoplug.kernels.quant import fp8, triton_fp8

BLOCK = (128, 128)


def unavailable(device: torch.device, n: int, k: int, block: tuple[int, int]) -> str | None:
    """Why cuBLAS cannot multiply this layer here (None: it can)."""
    if tuple(block) != BLOCK:
        return f"its {list(block)} blocks are not cuBLAS's [128, 128]"
    if n % 128 or k % 128:
        return f"its [{n}, {k}] is not whole [128, 128] blocks"
    return _device_reason(device)


@functools.lru_cache(maxsize=None)
def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"a {device.type} device"
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with block scaling"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "cuBLAS scales fp8 by [128, 128] blocks on SM90 (Hopper) only"
    try:  # a small product against dequantize-then-matmul: a cuBLAS too old for block scaling fails here
        gen = torch.Generator(device=device).manual_seed(0)
        w = (torch.randn(256, 256, device=device, generator=gen) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(2, 2, device=device, generator=gen) * 1e-3 + 1e-4
        x = torch.randn(5, 256, device=device, generator=gen, dtype=torch.bfloat16)
        out = matmul(x, w, weight_scales(scale)).float()
        q, s = triton_fp8.group_quant(x, 128)
        xq = fp8.dequantize_blocks(q, s, (1, 128), torch.float32)
        ref = xq @ fp8.dequantize_blocks(w, scale, BLOCK, torch.float32).t()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
    except Exception as exc:  # noqa: BLE001 (any failure is the reason it is not used)
        return f"cuBLAS's block-scaled fp8 GEMM failed here ({type(exc).__name__}: {str(exc)[:200]})"
    if not err < 1e-2:
        return f"cuBLAS's block-scaled fp8 GEMM is off by {err:.1e} of the product here"
    return None


def weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """A weight's block scales [N/128, K/128] as cuBLAS reads them: K blocks padded to a multiple of 4, [L4, N/128]."""
    pad = -scale.shape[1] % 4
    return F.pad(scale.float(), (0, pad)).contiguous().t()


def matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ (weight [N, K] e4m3 by [128, 128] blocks).T -> [M, N] in x's dtype; `scales`
    from weight_scales()."""
    m = x.shape[0]
    pad = -m % 4
    q, s = triton_fp8.group_quant(x, 128, token_major=True, rows=m + pad)
    out = F.scaled_mm(q, weight.t(), s, F.ScalingType.BlockWise1x128, scales, F.ScalingType.BlockWise128x128,
                      output_dtype=x.dtype)
    return out[:m] if pad else out
