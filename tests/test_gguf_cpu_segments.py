"""How the C++ GGUF linear method keeps a fused layer's parts: parts whose formats are kept in one block
format (Q5_0 widened to Q8_0 beside a Q8_0 part) pack into one segment, multiplied in one kernel call; Q5_0
parts alone keep their own panels where the kernels have a SIMD path for them; the products equal the parts'
gguf-py values, as separate segments do."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from _gguf_files import random_blocks
from nanoplug.checkpoint.gguf_file import GGUFTensor
from nanoplug.kernels.cpu import build
from nanoplug.kernels.cpu.quant_ops import SIMD_Q5_0, quant_kernels
from nanoplug.kernels.gguf.cpu_linear import Activations, cpu_method

K = 64


@pytest.fixture(scope="module")
def method():
    assert build.find_compiler() is not None, "these tests need a C++ compiler (g++ or clang++)"
    m = cpu_method()
    m.set_activations(Activations("float", 0, "float"))
    return m


def part(fmt: str, rows: int, seed: int) -> GGUFTensor:
    if fmt == "Q5_0":
        raw = random_blocks(fmt, rows, K, seed, scale=0.3)
    else:  # gguf-py quantizes the others
        values = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32) * 0.1
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt])
    return GGUFTensor("w", "w", int(gguf.GGMLQuantizationType[fmt]), fmt, (rows, K), np.asarray(raw))


def layer_of(method, parts: list[GGUFTensor]) -> nn.Module:
    layer = nn.Module()
    method.create_weights(layer, K, sum(p.shape[0] for p in parts), torch.float32)
    offset = 0
    for p in parts:
        method.load(layer, layer.weight, p, offset, p.shape[0])
        offset += p.shape[0]
    method.process_after_loading(layer)
    return layer


@pytest.mark.parametrize("formats, kept", [(("Q5_0", "Q5_0", "Q8_0"), ["Q8_0"]),
                                           (("Q5_0", "Q4_0", "Q8_0"), ["Q8_0", "Q4_0", "Q8_0"]),
                                           (("Q5_0", "Q5_0"), None)])
def test_parts_kept_in_one_format_are_one_segment(method, formats, kept):
    if kept is None:  # Q5_0 alone: its own panels, or Q8_0 ones where quant.cpp has no SIMD Q5_0
        kept = ["Q5_0" if quant_kernels().best in SIMD_Q5_0 else "Q8_0"]
    parts = [part(fmt, 32, seed) for seed, fmt in enumerate(formats)]
    layer = layer_of(method, parts)
    assert [s.fmt for s in layer.weight.gguf.segments] == kept
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(method.dequantized(layer), want)
    x = torch.randn(3, K)
    got = method.apply(layer, x, None)
    ref = (x.double() @ want.double().T).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
