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
from nanoplug.kernels.cpu.quant_ops import ACTS, SIMD_Q5_0, quant_kernels
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


@pytest.mark.parametrize("measured", [True, False])
def test_a_measured_float_choice_takes_int8x2_on_block_formats(measured, monkeypatch):
    """The per-CPU choice times float against int8x2 on the panels; a block format's float path dequantizes each row
    (far slower), so where a measured choice says float, block formats take int8x2 (the same quality class) and
    panels float; an explicit float (measured False) is taken as it is everywhere."""
    m = cpu_method()
    m.set_activations(Activations("float", 1 << 30, "float", measured=measured))
    seen = []
    alone = layer_of(m, [part("Q5_1", 32, 0)])  # one segment: its prepared matmul
    mm = alone.weight.gguf.mm
    alone.weight.gguf.mm = lambda x, bias, act: seen.append(("Q5_1", act)) or mm(x, bias, act)
    mixed = layer_of(m, [part("Q5_1", 32, 1), part("Q8_0", 32, 2)])  # two segments: a call each
    linear = m.kernels.linear
    monkeypatch.setattr(m.kernels, "linear", lambda x, fmt, *a, act, **k: seen.append((fmt, act)) or linear(
        x, fmt, *a, act=act, **k))
    x = torch.randn(2, K)
    for layer in (alone, mixed):
        want = (x.double() @ m.dequantized(layer).double().T).float()
        torch.testing.assert_close(m.apply(layer, x, None), want, rtol=2e-2, atol=2e-2)
    block = "int8x2" if measured else "float"
    assert seen == [("Q5_1", ACTS.index(block)), ("Q5_1", block), ("Q8_0", "float")]
