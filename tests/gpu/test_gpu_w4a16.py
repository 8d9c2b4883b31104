"""The Triton W4A16 kernels (nanoplug/kernels/quant/triton_w4a16.py) on CUDA in bfloat16, which the CPU
interpreter cannot check (it truncates float32 -> bfloat16 and its bfloat16 tl.dot is wrong): GEMV and GEMM
equal dequantize-then-matmul within bfloat16 output rounding, on the 8B shape's layer sizes. An engine on a
W4A16 checkpoint taking the Triton path: tests/gpu/test_gpu_quant_kernels.py.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_w4a16.py`."""
from __future__ import annotations

import pytest
import torch

from nanoplug.kernels.quant import int4, triton_w4a16
from nanoplug.kernels.quant.triton_w4a16 import w4a16_matmul

pytestmark = pytest.mark.gpu


def _weights(g: torch.Generator, n: int, k: int, group: int, asym: bool, dtype: torch.dtype):
    """Random int4 weights in int4.py's layout: (packed words, scales in `dtype`, zeros or None)."""
    dev = g.device
    q = torch.randint(0, 16, (n, k), generator=g, device=dev, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g, device=dev) * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, device=dev, dtype=torch.uint8) if asym else None
    return int4.pack_int4(q), scales, zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (40, 256)])
def test_bf16_kernels_equal_dequantize_then_matmul(n, k, asym, dtype):
    dev, group = torch.device("cuda"), 128
    g = torch.Generator(device=dev).manual_seed(0)
    packed, scales, zeros = _weights(g, n, k, group, asym, dtype)
    for m in (1, 2, 4, 16, 40, 80, 300, 600):  # GEMV, the GEMM's small, middle, large tiles, dequantize + cuBLAS
        # the GEMV multiplies float32 weights, the GEMMs weights rounded to bfloat16
        w = int4.dequantize_int4(packed, scales, zeros, torch.float32 if m <= triton_w4a16.GEMV_ROWS else dtype)
        x = torch.randn(m, k, generator=g, device=dev).to(dtype)
        ref = x.double() @ w.double().t()
        out = w4a16_matmul(x, packed, scales, zeros).double()
        bound = k * 2 ** -24 * (x.double().abs() @ w.double().abs().t()) + ref.abs() * 2 ** -8 + 1e-6
        assert ((out - ref).abs() <= bound).all(), (m, (out - ref).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym", [False, True])
def test_gemm_opens_the_weights_exactly(asym, dtype):
    """One-hot rows pick single columns: the GEMM's outputs are then its weight values, bit for bit those of
    dequantize_int4 rounded to x's dtype (the 16-bit paths open the words by PTX, the float32 path by shifts)."""
    dev, group, n, k = torch.device("cuda"), 128, 4096, 4096
    g = torch.Generator(device=dev).manual_seed(2)
    packed, scales, zeros = _weights(g, n, k, group, asym, dtype)
    w = int4.dequantize_int4(packed, scales, zeros, dtype)
    cols = torch.randperm(k, generator=g, device=dev)[:24]
    x = torch.zeros(24, k, device=dev, dtype=dtype)
    x[torch.arange(24, device=dev), cols] = 1.0
    assert torch.equal(w4a16_matmul(x, packed, scales, zeros), w[:, cols].t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("n,k,group", [(4096, 12288, 128), (40, 256, 128), (72, 512, 64)])
def test_dequantize_kernel_equals_dequantize_int4(n, k, group, asym, dtype):
    """The big batch's one-pass dequantization, bit for bit (16-bit types: the words opened by the GEMM's PTX;
    float32: by shifts), over row counts that are not a multiple of its block."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    packed, scales, zeros = _weights(g, n, k, group, asym, dtype)
    got = triton_w4a16.dequantize(packed, scales, zeros, dtype)
    assert torch.equal(got, int4.dequantize_int4(packed, scales, zeros, dtype))


@pytest.mark.parametrize("rows", [1, 2, 24])  # the GEMV, the GEMM's small and large tiles
@pytest.mark.parametrize("split", [1, 4, None])
def test_gemv_in_a_graph_replays_like_eager(split, rows):
    """The split GEMV's and GEMM's partials and counts are set back to zero by each call: replays of a graph of
    them over several layers (sharing those buffers) give the eager results every time."""
    dev, group = torch.device("cuda"), 128
    g = torch.Generator(device=dev).manual_seed(1)
    layers = []
    for n, k in ((6144, 4096), (4096, 12288), (1000, 4096)):
        layers.append(_weights(g, n, k, group, False, torch.bfloat16)[:2])
    xs = [torch.randn(rows, packed.shape[1] * 8, generator=g, device=dev).to(torch.bfloat16) for packed, _ in layers]

    def run():
        return [w4a16_matmul(x, packed, scales, None, split_k=split) for x, (packed, scales) in zip(xs, layers)]
    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(3):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager):
            assert torch.allclose(o.float(), e.float(), rtol=2 ** -7, atol=1e-3)


def test_tinygemm_equals_dequantize_then_matmul():
    """torch's int4 kernel (kernels/quant/tinygemm.py) on int4.py's symmetric layout, repacked: one-hot rows give
    dequantize_int4's bfloat16 values bit for bit, and random rows its matmul within float32 summation and the
    bfloat16 output's rounding, at every row count it takes."""
    from nanoplug.kernels.quant import tinygemm

    dev, group = torch.device("cuda"), 128
    g = torch.Generator(device=dev).manual_seed(3)
    for n, k in ((6144, 4096), (4096, 12288), (256, 128)):
        packed, scales, _ = _weights(g, n, k, group, False, torch.bfloat16)
        assert tinygemm.unavailable(dev, n, k, group, True, torch.bfloat16, scales) is None
        w = int4.dequantize_int4(packed, scales, None, torch.bfloat16)
        ops = tinygemm.pack(packed, scales)
        cols = torch.randperm(k, generator=g, device=dev)[:tinygemm.ROWS]
        onehot = torch.zeros(tinygemm.ROWS, k, device=dev, dtype=torch.bfloat16)
        onehot[torch.arange(tinygemm.ROWS, device=dev), cols] = 1.0
        assert torch.equal(tinygemm.matmul(onehot, *ops, group), w[:, cols].t())
        for m in range(1, tinygemm.ROWS + 1):
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            ref = x.double() @ w.double().t()
            out = tinygemm.matmul(x, *ops, group).double()
            bound = k * 2 ** -24 * (x.double().abs() @ w.double().abs().t()) + ref.abs() * 2 ** -8 + 1e-6
            assert ((out - ref).abs() <= bound).all(), (n, k, m, (out - ref).abs().max())


def test_a_symmetric_bf16_layer_decodes_on_tinygemm_and_batches_on_triton():
    """quant_kernels picks tinygemm for a symmetric bfloat16 layer (decode rows; more rows on the Triton GEMM), and
    the Triton path alone where it cannot serve (an asymmetric layer, float16)."""
    from torch import nn

    from nanoplug.plugins.weight_formats import quant_kernels

    dev, n, k, group = torch.device("cuda"), 512, 1024, 128
    g = torch.Generator(device=dev).manual_seed(4)
    for dtype, asym, expect in ((torch.bfloat16, False, "int4_tinygemm"), (torch.bfloat16, True, "int4_triton"),
                                (torch.float16, False, "int4_triton")):
        layer = nn.Module()
        layer.kind, layer.output_size, layer.input_size, layer.compute_dtype, layer.perm = "int4", n, k, dtype, None
        layer.qweight, layer.scales, layer.zeros = _weights(g, n, k, group, asym, dtype)
        kernel = quant_kernels.choose(layer)
        assert kernel.__name__ == expect
        w = int4.dequantize_int4(layer.qweight, layer.scales, layer.zeros, torch.float32)
        for m in (1, 3, 4, 5, 40):
            x = torch.randn(2, m, k, generator=g, device=dev).to(dtype)[0]
            ref = x.double() @ w.double().t()
            out = kernel(layer, x).double()
            assert out.shape == (m, n)
            assert ((out - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().max()).all(), (dtype, asym, m)
