"""The int4 layout (kernels/quant/int4.py) and the Triton W4A16 kernels (kernels/quant/triton_w4a16.py) under
TRITON_INTERPRET=1: each kernel equals dequantize-then-matmul within float32 rounding (GEMM on tensor cores for
batches, split-K GEMV for a few rows), symmetric and asymmetric, float32 and bfloat16 activations; the linear
method's Triton path with an activation order (columns sorted by group) equals its dequantized path."""
from __future__ import annotations

import pytest
import torch

from nanoplug.kernels.quant import int4, split_k, triton_w4a16, w4a16_gemm
from tests._triton_interpreter import interpreted


def _weights(n: int, k: int, group: int, asym: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8) if asym else None
    return q, int4.pack_int4(q), scales, zeros


def test_pack_unpack_roundtrip_and_layout():
    q, packed, _, _ = _weights(5, 64, 32, False)
    assert torch.equal(int4.unpack_int4(packed), q)
    # value k of a row at bits 4*(k % 8) of word k // 8 (compressed-tensors' pack-quantized order)
    assert int(packed[0, 0]) & 0xF == int(q[0, 0]) and (int(packed[0, 0]) >> 4) & 0xF == int(q[0, 1])
    assert torch.equal(int4.unpack_int4(int4.pack_int4(q.t().contiguous(), dim=0), dim=0), q.t())


def test_sort_by_group_refuses_uneven_groups():
    g_idx = torch.arange(64) // 32
    assert int4.sort_by_group(g_idx, 32) is None
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(g_idx[perm][int4.sort_by_group(g_idx[perm], 32)], g_idx)
    with pytest.raises(ValueError, match="32 columns in each group"):
        int4.sort_by_group(torch.zeros(64, dtype=torch.int64), 32)


@pytest.mark.parametrize("asym", [False, True])
# bfloat16 is left to the GPU tests: the interpreter rounds float32 -> bfloat16 by truncation and its bfloat16
# tl.dot returns garbage (triton 3.9), so it cannot be the reference here; float16 exercises the same code
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_equal_dequantize_then_matmul(asym, dtype):
    n, k, group = 40, 256, 128  # n not a multiple of a block
    _, packed, scales, zeros = _weights(n, k, group, asym)
    scales = scales.to(dtype)
    with interpreted(split_k, w4a16_gemm, triton_w4a16) as kern:
        # GEMV (split-K, whole), then the GEMM (its own split, K split in two, two row tiles)
        for m, split in ((1, None), (3, 2), (1, 1), (20, None), (5, 2), (37, 1)):
            # the GEMV multiplies float32 weights, the GEMM weights rounded to x's dtype
            w = int4.dequantize_int4(packed, scales, zeros, torch.float32 if m <= kern.GEMV_ROWS else dtype)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            out = kern.w4a16_matmul(x, packed, scales, zeros, split_k=split)
            ref = (x.double() @ w.double().t())
            bound = k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t()) + 1e-6
            if dtype == torch.float16:  # the output is rounded to float16
                bound = bound + ref.abs() * 2 ** -11
            assert out.dtype == dtype and out.shape == (m, n)
            assert ((out.double() - ref).abs() <= bound).all(), (m, (out.double() - ref).abs().max())


def test_split_gemv_leaves_its_buffers_at_zero(monkeypatch):
    """The split GEMV sums into shared float32 partials and counts that the last program of each tile sets back to
    zero (what a CUDA graph's replays rely on): a second call gives the same result, each row its own alone's, and
    the buffers read zero after every call. (Its rows past the first, which the GEMM takes by default, too.)"""
    n, k, group = 24, 512, 128
    _, packed, scales, zeros = _weights(n, k, group, True, seed=7)
    with interpreted(split_k, w4a16_gemm, triton_w4a16) as kern:
        monkeypatch.setattr(kern, "GEMV_ROWS", 4)
        x = torch.randn(4, k, generator=torch.Generator().manual_seed(8))
        alone = torch.cat([kern.w4a16_matmul(x[i:i + 1], packed, scales, zeros, split_k=4) for i in range(4)])
        for m in (1, 2, 3, 4):
            first = kern.w4a16_matmul(x[:m], packed, scales, zeros, split_k=4)
            part, count = split_k._BUFFERS[x.device]
            assert not part.any() and not count.any()
            assert torch.equal(kern.w4a16_matmul(x[:m], packed, scales, zeros, split_k=4), first)
            assert torch.allclose(first, alone[:m], rtol=1e-6, atol=1e-6)


def test_split_gemm_leaves_its_buffers_at_zero():
    """The GEMM's K split sums transposed tiles into the same shared partials: two calls give the same result,
    equal to the unsplit one within float32 rounding, and leave the buffers at zero."""
    n, k, group = 40, 512, 128
    _, packed, scales, zeros = _weights(n, k, group, True, seed=9)
    with interpreted(split_k, w4a16_gemm, triton_w4a16) as kern:
        x = torch.randn(21, k, generator=torch.Generator().manual_seed(10))
        whole = kern.w4a16_matmul(x, packed, scales, zeros, split_k=1)
        first = kern.w4a16_matmul(x, packed, scales, zeros, split_k=4)
        part, count = split_k._BUFFERS[x.device]
        assert not part.any() and not count.any()
        assert torch.equal(kern.w4a16_matmul(x, packed, scales, zeros, split_k=4), first)
        assert torch.allclose(first, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("asym", [False, True])
def test_dequantize_kernel_and_the_big_batch_path(asym, monkeypatch):
    """The one-pass dequantization equals dequantize_int4 exactly; past DEQUANT_ROWS rows the product is cuBLAS's
    (here torch's) on it."""
    n, k, group = 40, 256, 64
    _, packed, scales, zeros = _weights(n, k, group, asym, seed=5)
    scales = scales.to(torch.float16)
    with interpreted(split_k, w4a16_gemm, triton_w4a16) as kern:
        w = kern.dequantize(packed, scales, zeros, torch.float16)
        assert torch.equal(w, int4.dequantize_int4(packed, scales, zeros, torch.float16))
        monkeypatch.setattr(kern, "DEQUANT_ROWS", 6)
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(6)).to(torch.float16)
        assert torch.equal(kern.w4a16_matmul(x, packed, scales, zeros), torch.nn.functional.linear(x, w))


def test_linear_method_triton_path_with_activation_order():
    from torch import nn

    from nanoplug.plugins.weight_formats import quant_kernels
    from nanoplug.plugins.weight_formats.prequantized import PrequantizedLinearMethod, QuantizedWeight

    n, k, group = 32, 128, 32
    q, _, scales, zeros = _weights(n, k, group, True, seed=3)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=torch.Generator().manual_seed(4))]
    perm = int4.sort_by_group(g_idx, group)
    w_ref = (q.float() - zeros.float()[:, g_idx]) * scales[:, g_idx]  # GPTQ's act-order formula, column by column
    method = PrequantizedLinearMethod()
    layer = nn.Module()
    layer.role, layer.input_size, layer.output_size = "linear", k, n
    method.create_weights(layer, k, n, torch.float32)
    qw = QuantizedWeight("int4", torch.Size((n, k)), {"qweight": int4.pack_int4(q[:, perm]), "scales": scales,
                                                       "zeros": zeros, "perm": perm})
    method.load(layer, layer.weight, qw, 0, n)
    method.process_after_loading(layer)
    assert torch.equal(method.dequantized(layer, torch.float32), w_ref)
    x = torch.randn(2, k)
    layer.kernel = None  # the dequantized path (the CPU's own kernel is tested in test_int_weight_kernels.py)
    dense = method.apply(layer, x, None)
    with interpreted(split_k, w4a16_gemm, triton_w4a16):
        layer.kernel = quant_kernels.int4_triton
        fast = method.apply(layer, x, None)
    assert torch.allclose(fast, dense, atol=1e-4, rtol=1e-5)
    assert torch.allclose(dense, x @ w_ref.t(), atol=1e-4, rtol=1e-5)


def test_tinygemm_says_why_it_cannot_serve():
    """The decode kernel of kernels/quant/tinygemm.py names what stops it (here: the device; the rest on a GPU,
    tests/gpu/test_gpu_w4a16.py); quant_kernels then keeps the Triton GEMV for decode rows."""
    from nanoplug.kernels.quant import tinygemm

    scales = torch.ones(8, 1, dtype=torch.bfloat16)
    assert "CUDA" in tinygemm.unavailable(torch.device("cpu"), 8, 128, 128, True, torch.bfloat16, scales)


def test_int4_layers_route_decode_rows_to_tinygemm(monkeypatch):
    """Where tinygemm serves (a CUDA property, so its calls are stood in for here by the reference product),
    quant_kernels packs the layer once and sends it up to tinygemm.ROWS bfloat16 rows, in the checkpoint's column
    order, and more rows to the Triton kernels. The kernel itself: tests/gpu/test_gpu_w4a16.py."""
    from torch import nn

    from nanoplug.kernels.quant import tinygemm
    from nanoplug.plugins.weight_formats import quant_kernels

    n, k, group = 32, 128, 32
    _, packed, scales, _ = _weights(n, k, group, False, seed=5)
    scales = scales.to(torch.bfloat16)
    w = int4.dequantize_int4(packed, scales, None, torch.float32)
    calls = []

    def product(tag):
        def fn(x2, *args):
            calls.append((tag, x2.shape[0] if tag == "tinygemm" else x2.reshape(-1, k).shape[0]))
            return (x2.float() @ w.t()).to(x2.dtype)
        return fn

    monkeypatch.setattr(tinygemm, "unavailable", lambda *args: None)
    monkeypatch.setattr(tinygemm, "pack", lambda qw, s: (qw, s))
    monkeypatch.setattr(tinygemm, "matmul", product("tinygemm"))
    monkeypatch.setattr(quant_kernels, "int4_triton", lambda layer, x: product("triton")(
        x if layer.perm is None else x.index_select(-1, layer.perm)))
    layer = nn.Module()
    layer.kind, layer.output_size, layer.input_size, layer.compute_dtype = "int4", n, k, torch.bfloat16
    layer.qweight, layer.scales, layer.zeros = packed, scales, None
    layer.perm = torch.randperm(k, generator=torch.Generator().manual_seed(6))
    kernel = quant_kernels._tinygemm(layer, group)
    assert kernel is quant_kernels.int4_tinygemm and layer.group_size == group
    for shape in ((3, k), (2, 2, k), (5, k), (0, k)):
        x = torch.randn(*shape).to(torch.bfloat16)
        out = kernel(layer, x)
        assert out.shape == (*shape[:-1], n)
        assert torch.allclose(out.float(), (x.float()[..., layer.perm] @ w.t()).to(torch.bfloat16).float())
    assert calls == [("tinygemm", 3), ("tinygemm", 4), ("triton", 5), ("triton", 0)]
    layer.expert = True  # an MoE expert's layer (ExpertLayers) keeps one copy: the Triton kernels only
    assert quant_kernels._tinygemm(layer, group) is None
