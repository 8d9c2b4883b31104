"""The Triton W4A16 kernels (nanoplug/kernels/quant/triton_w4a16.py) on CUDA in bfloat16, which the CPU
interpreter cannot check (it truncates float32 -> bfloat16 and its bfloat16 tl.dot is wrong): GEMV and GEMM
equal dequantize-then-matmul within bfloat16 output rounding, on the 8B shape's layer sizes. An engine on a
W4A16 checkpoint taking the Triton path: tests/gpu/test_gpu_quant_kernels.py.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_w4a16.py`."""
from __future__ import annotations

import pytest
import torch

from nanoplug.kernels.quant import int4
from nanoplug.kernels.quant.triton_w4a16 import w4a16_matmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (40, 256)])
def test_bf16_kernels_equal_dequantize_then_matmul(n, k, asym, dtype):
    dev, group = torch.device("cuda"), 128
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g, device=dev, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g, device=dev) * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, device=dev, dtype=torch.uint8) if asym else None
    packed = int4.pack_int4(q)
    for m in (1, 2, 4, 16, 40, 300, 600):  # GEMV, the GEMM's small, middle and large tiles, dequantize + cuBLAS
        # the GEMV multiplies float32 weights, the GEMMs weights rounded to bfloat16
        w = int4.dequantize_int4(packed, scales, zeros, torch.float32 if m <= 4 else dtype)
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
    q = torch.randint(0, 16, (n, k), generator=g, device=dev, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g, device=dev) * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, device=dev, dtype=torch.uint8) if asym else None
    packed = int4.pack_int4(q)
    w = int4.dequantize_int4(packed, scales, zeros, dtype)
    cols = torch.randperm(k, generator=g, device=dev)[:24]
    x = torch.zeros(24, k, device=dev, dtype=dtype)
    x[torch.arange(24, device=dev), cols] = 1.0
    assert torch.equal(w4a16_matmul(x, packed, scales, zeros), w[:, cols].t())


@pytest.mark.parametrize("rows", [2, 24])  # the GEMV, the GEMM
@pytest.mark.parametrize("split", [1, 4, None])
def test_gemv_in_a_graph_replays_like_eager(split, rows):
    """The split GEMV's and GEMM's partials and counts are set back to zero by each call: replays of a graph of
    them over several layers (sharing those buffers) give the eager results every time."""
    dev, group = torch.device("cuda"), 128
    g = torch.Generator(device=dev).manual_seed(1)
    layers = []
    for n, k in ((6144, 4096), (4096, 12288), (1000, 4096)):
        q = torch.randint(0, 16, (n, k), generator=g, device=dev, dtype=torch.uint8)
        scales = (torch.rand(n, k // group, generator=g, device=dev) * 0.01).to(torch.bfloat16)
        layers.append((int4.pack_int4(q), scales))
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
