"""The Triton fp8 block-scaled kernels (kernels/quant/triton_fp8.py) under TRITON_INTERPRET=1, against
dequantize-then-matmul (transformers' fine-grained FP8 formula, kernels/quant/fp8.py):

- the per-token-group activation quantization equals a plain torch one (vLLM's formula) bit for bit;
- GEMV (in-kernel activation quantization, split-K or whole) and GEMM (fp8 tl.dot) equal the float64 product
  of the e4m3-rounded activations and the dequantized weights within float32 rounding (K * eps * sum |x w|);
- and so (tests/gpu/test_gpu_fp8_block.py) the exact product within the fp8 rounding of the activations: each
  activation is off by at most 2^-4 |x| (e4m3 keeps 3 mantissa bits, round to nearest) or, below e4m3's normal
  range, half its smallest step (scale * 2^-10): |error| <= sum_k |w_k| (2^-4 |x_k| + s_g(k) 2^-10) + the
  float32 term.

Triton 3.9's interpreter casts float32 to e4m3 wrongly where rounding carries into the exponent (124.7 -> 64,
not 128), so here the activations are e4m3 values times a power of two per group (each group holding 448),
which every cast keeps exactly; random activations and the rounding bound run on the GPU
(tests/gpu/test_gpu_fp8_block.py), where the cast is the hardware's round-to-nearest.
"""
from __future__ import annotations

import pytest
import torch

from nanoplug.kernels.quant import fp8, split_k, triton_fp8
from tests._triton_interpreter import interpreted

FP8 = torch.float8_e4m3fn


def group_quant_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per_token_group_quant_fp8 in plain torch (float32)."""
    g = x.float().unflatten(-1, (-1, group))
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (g / scale).clamp(-448.0, 448.0).to(FP8)
    return q.flatten(-2), scale.squeeze(-1)


def weights(n: int, k: int, block=(128, 128), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-3 + 1e-4
    return w, scale


def representable(m: int, k: int, group: int, seed: int) -> torch.Tensor:
    """Activations that quantize exactly: e4m3 values (448 first in each group) times a power of two per group."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(m, k, generator=g) * 100).clamp(-448, 448).to(FP8).float()
    v[:, ::group] = 448.0
    s = 2.0 ** torch.randint(-8, 2, (m, k // group), generator=g).float()
    return (v.unflatten(-1, (-1, group)) * s[..., None]).flatten(-2)


def test_group_quant_equals_the_reference():
    x = representable(3, 256, 128, seed=1)
    x[1, :128] = 0.0  # a group of zeros
    with interpreted(split_k, triton_fp8) as kern:
        q, s = kern.group_quant(x, 128)
    q_ref, s_ref = group_quant_reference(x, 128)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_group_quant_pads_rows_as_zeros_in_the_token_major_layout():
    """cuBLAS's padded rows (cublas_fp8.matmul) come out of the quantizer, not a copy of x: rows past x's are q 0
    with the floor scale, the others as unpadded, in the token-major scales cuBLAS reads."""
    x = representable(3, 256, 128, seed=2)
    with interpreted(split_k, triton_fp8) as kern:
        q, s = kern.group_quant(x, 128, token_major=True, rows=4)
        q3, s3 = kern.group_quant(x, 128)
    assert q.shape == (4, 256) and s.shape == (4, 2) and s.stride() == (1, 4)
    assert torch.equal(q[:3].view(torch.uint8), q3.view(torch.uint8)) and torch.equal(s[:3], s3)
    assert not q[3].float().any() and torch.equal(s[3], torch.full((2,), 1e-10 / 448.0))


@pytest.mark.parametrize("m,split", [(1, None), (3, 2), (2, 1), (20, None)])  # GEMV (split-K, whole), GEMM
def test_kernels_equal_dequantize_then_matmul(m, split):
    n, k, block = 160, 384, (128, 128)  # N not a multiple of a block: the last block row is partial
    w, scale = weights(n, k, block)
    w_deq = fp8.dequantize_blocks(w, scale, block, torch.float64)
    x = representable(m, k, block[1], seed=m)
    with interpreted(split_k, triton_fp8) as kern:
        out = kern.fp8_block_matmul(x, w, scale, block, split_k=split)
    assert out.dtype == x.dtype and out.shape == (m, n)
    xq, xs = group_quant_reference(x, block[1])
    x_rounded = (xq.double().unflatten(-1, (-1, block[1])) * xs.double()[..., None]).flatten(-2)
    f32 = k * torch.finfo(torch.float32).eps * (x_rounded.abs() @ w_deq.abs().t()) + 1e-12
    err = (out.double() - x_rounded @ w_deq.t()).abs()
    assert (err <= f32).all(), err.max()


def test_linear_method_takes_the_kernel_for_fp8_blocks():
    """The pre-quantized linear method on an fp8_block layer: its Triton path equals its dequantized one
    (activations quantized per group of 128, as the checkpoint says) within float32 rounding."""
    from torch import nn

    from nanoplug.plugins.weight_formats import quant_kernels
    from nanoplug.plugins.weight_formats.prequantized import PrequantizedLinearMethod, QuantizedWeight

    n, k, block = 256, 256, (128, 128)
    w, scale = weights(n, k, block, seed=2)
    method = PrequantizedLinearMethod()
    layer = nn.Module()
    layer.role, layer.input_size, layer.output_size = "linear", k, n
    method.create_weights(layer, k, n, torch.float32)
    method.load(layer, layer.weight, QuantizedWeight("fp8_block", torch.Size((n, k)), {"qweight": w, "scales": scale},
                                                     block, ("float", 128)), 0, n)
    method.process_after_loading(layer)
    assert layer.kernel is None  # no fp8 GEMM on a CPU: dequantized
    x = representable(2, k, block[1], seed=3)
    plain = method.apply(layer, x, None)
    with interpreted(split_k, triton_fp8):
        layer.kernel = quant_kernels.fp8_block_triton
        fast = method.apply(layer, x, None)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
