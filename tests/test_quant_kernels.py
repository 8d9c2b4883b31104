"""The GGUF weight kernels (nanoplug/cpu_kernels/quant.cpp) against references no one here wrote:

- repack + dequantize equals gguf-py's own `gguf.quants.dequantize` bit for bit, for Q4_0, Q4_1,
  Q5_0, Q8_0 and Q4_K blocks (quantized by gguf-py where it can, random bytes with sane scales for Q4_K),
  whole tensors and gathered rows;
- the float32-activation GEMM equals dequantize-then-float64-matmul within float32 rounding (the
  a-priori bound K * eps * sum|w x|);
- the int8-activation GEMM: its activation blocks equal an independent numpy quantization, its result
  equals the float64 product with those quantized activations within float32 rounding, and the
  product with the exact activations within its own derived bound (each activation is off by at most
  half its block's scale: |error| <= sum_k |w_k| d_block(k) / 2, plus rounding);
- the int8x2-activation GEMM (int8 blocks of x and of its residual, the default): within 1/254 of that
  bound of the exact product (the residual's scale is at most half the first scale over 127), which is
  float32 compute's quality;

on every dispatch path this CPU runs (the portable one always), odd shapes (rows not a multiple of a
panel, one row, more rows than a tile or a task), strided activations and a bias. The tensors of the
default model's GGUF file are checked in test_gguf_model.py."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoplug.kernels.cpu import build
from nanoplug.kernels.cpu.quant_ops import BLOCKS, FORMATS, quant_kernels

EPS32 = np.finfo(np.float32).eps


@pytest.fixture(scope="module")
def qk():
    assert build.find_compiler() is not None, "these tests need a C++ compiler (g++ or clang++)"
    return quant_kernels()


def blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """The file's blocks of a random [n, k] weight: uint8 [n, bytes per row]."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt != "Q4_K":  # gguf-py quantizes these: realistic blocks
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block (scale 0)
        return gguf.quants.quantize(w, qtype)
    block, size = BLOCKS[FORMATS[fmt]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(rng.uniform(1e-4, 2e-2, n * k // block).astype(np.float16).tobytes(),
                                  np.uint8).reshape(n, k // block, 2)  # d
    raw[..., 2:4] = np.frombuffer(rng.uniform(1e-4, 2e-2, n * k // block).astype(np.float16).tobytes(),
                                  np.uint8).reshape(n, k // block, 2)  # dmin
    return raw.reshape(n, -1)


def reference(fmt: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(n, k)


SHAPES = {"Q4_0": [(1, 32), (17, 96), (48, 160)], "Q4_1": [(1, 32), (17, 96), (45, 576)],
          "Q5_0": [(1, 32), (17, 96), (33, 160)],
          "Q8_0": [(1, 32), (17, 96), (33, 160)], "Q4_K": [(1, 256), (17, 512), (40, 256)]}
CASES = [(fmt, n, k) for fmt, shapes in SHAPES.items() for n, k in shapes]


@pytest.mark.parametrize("fmt,n,k", CASES)
def test_dequantize_equals_gguf_py_exactly(qk, fmt, n, k):
    raw = blocks(fmt, n, k)
    packed = qk.pack(fmt, torch.from_numpy(raw), n, k)
    ref = reference(fmt, raw, n, k)
    got = qk.dequantize(fmt, packed, n, k).numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))  # bit for bit, signed zeros included
    ids = torch.tensor([[n - 1, 0], [n // 2, n - 1]])
    assert np.array_equal(qk.dequantize(fmt, packed, n, k, ids).numpy(), ref[ids.numpy()])


def test_q5_0_every_bit_pattern(qk):
    """Random bytes as Q5_0 blocks (every fifth-bit pattern, which gguf-py's quantizer may not write): exact
    dequantization, and every path's product equal to the float64 one within float32 rounding."""
    from _gguf_files import random_blocks

    n, k = 17, 96
    raw = random_blocks("Q5_0", n, k, seed=4, scale=0.3)
    packed = qk.pack("Q5_0", torch.from_numpy(raw), n, k)
    ref = reference("Q5_0", raw, n, k)
    assert np.array_equal(qk.dequantize("Q5_0", packed, n, k).numpy().view(np.uint32), ref.view(np.uint32))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    exact = x.numpy().astype(np.float64) @ ref.astype(np.float64).T
    bound = k * EPS32 * (np.abs(x.numpy()) @ np.abs(ref).T) + 1e-30
    for isa in qk.isas:
        got = qk.linear(x, "Q5_0", packed, n, k, act="float", isa=isa).numpy()
        assert np.all(np.abs(got - exact) <= bound), isa


def test_packed_size_is_the_files(qk):
    """Bytes per weight stay the file's (Q4_K: 148 bytes per 256 weights instead of 144), up to the
    padding of the last panel of 16 rows."""
    for fmt, per in (("Q4_0", 18 / 32), ("Q4_1", 20 / 32), ("Q5_0", 22 / 32), ("Q8_0", 34 / 32), ("Q4_K", 148 / 256)):
        assert qk.packed_size(fmt, 4096, 4096) == 4096 * 4096 * per
    assert qk.packed_size("Q4_1", 17, 32) == 32 * 20


def test_bad_inputs_say_what_is_wrong(qk):
    with pytest.raises(ValueError, match="whole blocks of 256"):
        qk.packed_size("Q4_K", 16, 96)
    with pytest.raises(ValueError, match="not served"):
        qk.packed_size("Q5_K", 16, 256)
    with pytest.raises(ValueError, match=r"uint8 \[16, 60\]"):
        qk.pack("Q4_1", torch.zeros(16, 40, dtype=torch.uint8), 16, 96)
    packed = qk.pack("Q8_0", torch.from_numpy(blocks("Q8_0", 16, 32)), 16, 32)
    with pytest.raises(IndexError):
        qk.dequantize("Q8_0", packed, 16, 32, torch.tensor([16]))
    with pytest.raises(ValueError, match="does not run on this CPU|float32"):
        qk.linear(torch.zeros(1, 32, dtype=torch.float64), "Q8_0", packed, 16, 32)


def quantize_like_llama_cpp(x: np.ndarray):
    """An independent numpy version of the int8 path's activation blocks (llama.cpp's Q8_1 rule)."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(b).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), d


ROWS = [1, 2, 3, 8, 9, 33, 64, 130]  # one row, the tile sizes and their remainders, two row tasks


@pytest.mark.parametrize("fmt,n,k", [c for c in CASES if c[1] > 1])
def test_linear_on_every_path(qk, fmt, n, k):
    assert "portable" in qk.isas
    raw = blocks(fmt, n, k, seed=1)
    packed = qk.pack(fmt, torch.from_numpy(raw), n, k)
    w = reference(fmt, raw, n, k).astype(np.float64)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    for rows in ROWS:
        wide = torch.randn(rows, k + 7, generator=gen) * 3
        x = wide[:, 3:3 + k]  # rows strided, as a view of a wider tensor
        xn = x.numpy().astype(np.float64)
        exact = xn @ w.T + bias.numpy()
        bound_exact = k * EPS32 * (np.abs(xn) @ np.abs(w).T + np.abs(bias.numpy())) + 1e-30
        q, d = quantize_like_llama_cpp(x.numpy())
        xq = (q.reshape(rows, -1, 32) * d[..., None].astype(np.float64)).reshape(rows, k)
        with_xq = xq @ w.T + bias.numpy()
        bound_q = k * EPS32 * (np.abs(xq) @ np.abs(w).T + np.abs(bias.numpy())) + 1e-30
        derived = (np.abs(w).reshape(n, -1, 32).sum(-1) @ (d.astype(np.float64) / 2).T).T  # [rows, n]
        for isa in qk.isas:
            got = qk.linear(x, fmt, packed, n, k, bias, act="float", isa=isa).numpy()
            assert np.all(np.abs(got - exact) <= bound_exact), (isa, rows, np.abs(got - exact).max())
            got_q, got_d, _, got_sum = qk.quantize_activations(x, isa=isa)
            assert np.array_equal(got_q.numpy(), q) and np.array_equal(got_d.numpy(), d), (isa, rows)
            assert np.array_equal(got_sum.numpy(), q.reshape(rows, -1, 32).astype(np.int32).sum(-1))
            got8 = qk.linear(x, fmt, packed, n, k, bias, act="int8", isa=isa).numpy()
            assert np.all(np.abs(got8 - with_xq) <= bound_q), (isa, rows, np.abs(got8 - with_xq).max())
            assert np.all(np.abs(got8 - exact) <= derived + bound_exact), (isa, rows)
            got2 = qk.linear(x, fmt, packed, n, k, bias, act="int8x2", isa=isa).numpy()
            assert np.all(np.abs(got2 - exact) <= derived / 254 + 2 * bound_exact), (isa, rows, np.abs(got2 - exact).max())
            if rows > 1:  # a row alone (batch-1 decode's own kernel on AVX2) equals the same row in a batch
                for act, batched in (("int8", got8), ("int8x2", got2)):
                    alone = qk.linear(x[:1], fmt, packed, n, k, bias, act=act, isa=isa).numpy()
                    assert np.array_equal(alone, batched[:1]), (isa, act, rows)


def test_zero_rows_and_zero_activations(qk):
    raw = blocks("Q4_1", 32, 64)
    packed = qk.pack("Q4_1", torch.from_numpy(raw), 32, 64)
    for isa in qk.isas:
        assert qk.linear(torch.zeros(0, 64), "Q4_1", packed, 32, 64, isa=isa).shape == (0, 32)
        for act in ("int8", "int8x2", "float"):  # an all-zero block quantizes to scale 0, not NaN
            assert torch.equal(qk.linear(torch.zeros(3, 64), "Q4_1", packed, 32, 64, act=act, isa=isa),
                               torch.zeros(3, 32))


def test_threads_give_the_same_result(qk):
    """Each output element is computed by one task, so the thread count cannot change a bit; 130 rows make
    three row tasks, so the activations are quantized by several threads too."""
    raw = blocks("Q4_1", 3072, 576)
    packed = qk.pack("Q4_1", torch.from_numpy(raw), 3072, 576)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [qk.linear(x, "Q4_1", packed, 3072, 576, act=act) for act in ("int8", "int8x2", "float")]
        torch.set_num_threads(max(2, threads))
        two = [qk.linear(x, "Q4_1", packed, 3072, 576, act=act) for act in ("int8", "int8x2", "float")]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
