"""Which kernel multiplies a pre-quantized layer (prequantized.py) where its weights live, chosen once after
loading; where none serves, the layer is dequantized per call and the reason is logged once:

| kind      | CUDA                                                        | CPU                          |
| int4      | Triton W4A16 GEMM/GEMV (kernels/quant/triton_w4a16.py); decode | C++ (kernels/cpu/int_weights) |
|           | rows on torch's tinygemm (kernels/quant/tinygemm.py) where it serves |                   |
| int8 W8A8 | torch._int_mm, per-token int8 activations                   | C++ (kernels/cpu/int_weights) |
| fp8 rows  | torch._scaled_mm, per-token e4m3 activations (sm89+)        | dequantized (no fp8 GEMM)    |
| fp8 block | Triton block-scaled fp8 GEMV/GEMM (kernels/quant/triton_fp8); on SM90 the GEMM is cuBLAS's
|           | block-scaled one (kernels/quant/cublas_fp8)                  | dequantized (no fp8 GEMM)   |

Each kernel is `fn(layer, x) -> x @ W.T` (no bias), equal to the dequantized path within float rounding (the
int8 ones exactly in their integer sums; the fp8 block one within e4m3 rounding of the activations, which the
checkpoint's dynamic scheme or vLLM's kernel quantize too).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from nanoplug.kernels.quant import tinygemm
from nanoplug.kernels.quant.activations import quantize

log = logging.getLogger("nanoplug")
FP8_MAX = 448.0
Kernel = Callable[[nn.Module, torch.Tensor], torch.Tensor]
_said: set[str] = set()


def choose(layer: nn.Module) -> Kernel | None:
    """The kernel for this loaded layer on its device, or None (the reason logged once)."""
    kernel, why = _choose(layer)
    if kernel is None and why and why not in _said:
        _said.add(why)
        log.info("pre-quantized %s weights are dequantized per call: %s", layer.kind, why)
    return kernel


def _fp8_gemm_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"a {device.type} device has no fp8 GEMM"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"fp8 GEMMs need compute capability 8.9 or later (Ada, Hopper); this GPU is {major}.{minor}"
    return None


def _choose(layer: nn.Module) -> tuple[Kernel | None, str | None]:
    kind, dev = layer.kind, layer.qweight.device
    n, k = layer.output_size, layer.input_size
    if kind == "int4":
        if dev.type == "cuda":
            from nanoplug.kernels.quant import triton_w4a16

            if triton_w4a16.triton is None:
                return None, f"triton does not import ({triton_w4a16.TRITON_ERROR})"
            group_size = k // layer.scales.shape[1]
            if triton_w4a16.block_k(k, group_size) is None:
                return None, f"no K step of 16-128 divides its {k} columns and groups"
            return _tinygemm(layer, group_size) or int4_triton, None
        if dev.type == "cpu":
            return _cpu(layer, int4_cpu)
    elif kind == "int8":
        if layer.act != ("int", None):
            return None, f"its activations are not quantized per token (scheme {layer.act})"
        if dev.type == "cuda":
            if k % 8 or n % 8:
                return None, f"torch._int_mm needs sizes a multiple of 8 (this layer is [{n}, {k}])"
            return int8_int_mm, None
        if dev.type == "cpu":
            return _cpu(layer, int8_cpu)
    elif kind == "fp8":
        why = _fp8_gemm_reason(dev)
        if why:
            return None, why
        if layer.act != ("float", None):
            return None, f"torch._scaled_mm's row-wise path needs per-token activations (scheme {layer.act})"
        if k % 16 or n % 16:
            return None, f"torch._scaled_mm needs sizes a multiple of 16 (this layer is [{n}, {k}])"
        return fp8_scaled_mm, None
    elif kind == "fp8_block":
        why = _fp8_gemm_reason(dev)
        if why:
            return None, why
        from nanoplug.kernels.quant import triton_fp8

        if triton_fp8.triton is None:
            return None, f"triton does not import ({triton_fp8.TRITON_ERROR})"
        if layer.act not in (None, ("float", layer.block[1])):
            return None, f"its activations are quantized as {layer.act}, not per group of {layer.block[1]}"
        why = triton_fp8.supported(n, k, layer.block)
        if why:
            return None, why
        from nanoplug.kernels.quant import cublas_fp8

        if cublas_fp8.unavailable(dev, n, k, layer.block) is None:  # prefill batches on cuBLAS's fp8 GEMM
            layer.cublas_scales = cublas_fp8.weight_scales(layer.scales)
            return fp8_block_cublas, None
        return fp8_block_triton, None
    return None, f"no kernel serves {kind} weights on {dev.type}"


def _tinygemm(layer: nn.Module, group_size: int) -> Kernel | None:
    """int4_tinygemm where torch's int4 kernel serves this layer (its packed copy made now), else None (the reason
    logged once: the Triton GEMV then takes the decode rows)."""
    if getattr(layer, "expert", False):  # (ExpertLayers)
        why = "an expert's weights are kept once (a second packing would double the experts' memory)"
    else:
        why = tinygemm.unavailable(layer.qweight.device, layer.output_size, layer.input_size, group_size,
                                   layer.zeros is None, layer.compute_dtype, layer.scales)
    if why:
        if why not in _said:
            _said.add(why)
            log.info("int4 decode rows on the Triton GEMV, not torch's tinygemm: %s", why)
        return None
    layer.tinygemm = tinygemm.pack(layer.qweight, layer.scales)
    layer.group_size = group_size
    said = "int4 decode rows (up to %d) on torch's tinygemm kernel, batches on the Triton GEMM: each layer keeps both"
    if said not in _said:
        _said.add(said)
        log.info(said + " layouts (half a byte a weight more)", tinygemm.ROWS)
    return int4_tinygemm


def _cpu(layer: nn.Module, kernel: Kernel) -> tuple[Kernel | None, str | None]:
    from nanoplug.kernels.cpu import int_weights

    why = int_weights.unavailable()
    if why:
        return None, f"the C++ kernels are unavailable ({why})"
    if layer.input_size % 16:
        return None, f"its {layer.input_size} input columns are not a multiple of 16"
    if kernel is int4_cpu and layer.scales.dtype != torch.float32:
        layer.scales = layer.scales.float()  # the kernel reads float32 scales; dequantize_int4 casts to it anyway
    return kernel, None


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def int4_triton(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from nanoplug.kernels.quant import triton_w4a16

    xs = x if layer.perm is None else x.index_select(-1, layer.perm)
    return triton_w4a16.w4a16_matmul(xs, layer.qweight, layer.scales, layer.zeros)


def int4_tinygemm(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Decode rows (up to tinygemm.ROWS) on torch's tinygemm, batches on the Triton GEMM."""
    if not 0 < x.numel() <= tinygemm.ROWS * x.shape[-1] or x.dtype != torch.bfloat16:
        return int4_triton(layer, x)
    xs = x if layer.perm is None else x.index_select(-1, layer.perm)
    return tinygemm.matmul(_rows(xs), *layer.tinygemm, layer.group_size).view(*x.shape[:-1], -1)


def int4_cpu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from nanoplug.kernels.cpu import int_weights

    xs = x if layer.perm is None else x.index_select(-1, layer.perm)
    out = int_weights.kernels().int4_linear(_rows(xs).float(), layer.qweight, layer.scales, layer.zeros)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def _int8_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize(_rows(x), "int")  # the checkpoint's scheme: the reference path's q and scales
    return q.to(torch.int8), scale.float().view(-1)


def int8_int_mm(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    q, scale = _int8_act(x)
    m = q.shape[0]
    if m <= 16:  # torch._int_mm takes more than 16 rows
        q = torch.cat([q, q.new_zeros(17 - m, q.shape[1])])
    acc = torch._int_mm(q, layer.qweight.t())[:m]
    out = acc.float() * scale[:, None] * layer.scales[None, :]
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def int8_cpu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from nanoplug.kernels.cpu import int_weights

    q, scale = _int8_act(x)
    out = int_weights.kernels().int8_linear(q, scale, layer.qweight, layer.scales)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def fp8_scaled_mm(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x quantized per row (token) to e4m3, one row-wise scaled fp8 GEMM with the weight's row scales."""
    x2 = _rows(x)
    x_scale = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(xq, layer.qweight.t(), scale_a=x_scale, scale_b=layer.scales.view(1, -1),
                           out_dtype=torch.bfloat16)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def fp8_block_triton(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from nanoplug.kernels.quant import triton_fp8

    return triton_fp8.fp8_block_matmul(x, layer.qweight, layer.scales, layer.block)


def fp8_block_cublas(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Decode rows (and float32) on the Triton GEMV, batches on cuBLAS's block-scaled fp8 GEMM."""
    from nanoplug.kernels.quant import cublas_fp8, triton_fp8

    x2 = _rows(x)
    if x2.shape[0] <= triton_fp8.GEMV_ROWS or x2.dtype == torch.float32:
        return triton_fp8.fp8_block_matmul(x, layer.qweight, layer.scales, layer.block)
    return cublas_fp8.matmul(x2, layer.qweight, layer.cublas_scales).view(*x.shape[:-1], -1)
