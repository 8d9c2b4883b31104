"""The CPU kernels of the GGUF types kept in the file's blocks by kquants.cpp (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS,
Q5_0, Q5_1, IQ4_NL) against references no one here wrote:

- dequantization equals gguf-py's `gguf.quants.dequantize` bit for bit, on tensors llama.cpp's quantizer
  wrote (tests/data/llama_cpp_quants.gguf, written by `benchmarks/quantize_gguf.py --test-data`), on gguf-py's own
  quantization (Q5_0, Q5_1) and on random blocks (every bit pattern of the quants and scales);
- the int8 activation blocks equal an independent numpy quantization (llama.cpp's Q8_K rule for the
  K-quants, amax/127 blocks of 32 for the others), and int8x2's second set that quantization of the residual;
- the int8 GEMM equals the float64 product of gguf-py's weights with those quantized activations within
  float32 rounding, the int8x2 GEMM the product with both sets' sum (the two-pass integer dot), and the
  float32 GEMM the product with the exact activations; int8x2 lands far closer to that than int8;

on every dispatch path this CPU runs (the portable one always), one row, several row tiles, strided
activations and a bias."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from _gguf_files import _RANDOM_D, random_blocks as _random_blocks
from nanoplug.kernels.cpu import build
from nanoplug.kernels.cpu.kquant_ops import BLOCKS, FORMATS, K_QUANTS, kquant_kernels

EPS32 = np.finfo(np.float32).eps
DATA = Path(__file__).parent / "data" / "llama_cpp_quants.gguf"
@pytest.fixture(scope="module")
def kq():
    assert build.find_compiler() is not None, "these tests need a C++ compiler (g++ or clang++)"
    return kquant_kernels()


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes as blocks of a [n, k] weight, float16 factors of either sign up to 2e-2 (large scales)."""
    return _random_blocks(fmt, n, k, seed, scale=2e-2 / _RANDOM_D[fmt])


def llama_cpp_tensors() -> dict[str, np.ndarray]:
    """type name -> blocks [rows, bytes] of a tensor llama.cpp's quantizer wrote (committed file)."""
    reader = gguf.GGUFReader(str(DATA))
    out = {}
    for t in reader.tensors:
        out.setdefault(t.tensor_type.name, []).append(np.asarray(t.data).reshape(int(t.shape[-1]), -1))
    return out


def reference(fmt: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(raw.shape[0], -1)


SHAPES = {fmt: [(1, 256), (19, 512)] if FORMATS[fmt] in K_QUANTS else [(1, 32), (19, 96)] for fmt in FORMATS}
CASES = [(fmt, n, k) for fmt, shapes in SHAPES.items() for n, k in shapes]


def check_dequantize(kq, fmt: str, raw: np.ndarray) -> None:
    n, k = raw.shape[0], reference(fmt, raw[:1]).shape[1]
    packed = kq.pack(fmt, torch.from_numpy(raw), n, k)
    ref = reference(fmt, raw)
    got = kq.dequantize(fmt, packed, n, k).numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), fmt  # bit for bit, signed zeros included
    ids = torch.tensor([[n - 1, 0], [n // 2, n - 1]])
    assert np.array_equal(kq.dequantize(fmt, packed, n, k, ids).numpy(), ref[ids.numpy()])


@pytest.mark.parametrize("fmt,n,k", CASES)
def test_dequantize_random_blocks_equals_gguf_py_exactly(kq, fmt, n, k):
    check_dequantize(kq, fmt, random_blocks(fmt, n, k))


def test_dequantize_llama_cpp_and_gguf_py_quantizations_exactly(kq):
    tensors = llama_cpp_tensors()
    assert set(FORMATS) <= set(tensors), f"{DATA.name} lacks {set(FORMATS) - set(tensors)}"
    for fmt, raws in tensors.items():
        if fmt in FORMATS:
            for raw in raws:
                check_dequantize(kq, fmt, raw)
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    for fmt in ("Q5_0", "Q5_1"):
        check_dequantize(kq, fmt, gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt]))


def test_q5_0_widened_to_q8_0_keeps_gguf_py_values_exactly():
    """The C++ path keeps Q5_0 as Q8_0 panels beside Q8_0 parts (kernels/gguf/cpu_linear.py WIDENED): every bit pattern of its blocks,
    and llama.cpp's own Q5_0 tensors, dequantize through Q8_0 to gguf-py's Q5_0 values bit for bit."""
    from nanoplug.kernels.gguf.cpu_linear import q5_0_as_q8_0

    raws = [random_blocks("Q5_0", 5, 128), *llama_cpp_tensors()["Q5_0"]]
    for raw in raws:
        wide = q5_0_as_q8_0(torch.from_numpy(np.ascontiguousarray(raw)))
        got = gguf.quants.dequantize(wide.numpy(), gguf.GGMLQuantizationType.Q8_0)
        want = reference("Q5_0", raw)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def quantize_reference(fmt: str, x: np.ndarray):
    """Independent numpy quantization of activations (float64 -> the same float32 steps)."""
    m, k = x.shape
    if FORMATS[fmt] in K_QUANTS:  # llama.cpp's quantize_row_q8_K_ref
        xb = x.reshape(m, k // 256, 256)
        imax = np.abs(xb).argmax(-1)
        mx = np.take_along_axis(xb, imax[..., None], -1)[..., 0]
        with np.errstate(divide="ignore"):
            iscale = np.where(mx == 0, 0, np.float32(-127) / mx).astype(np.float32)
        q = np.minimum(np.rint(xb * iscale[..., None]), 127).astype(np.int8)
        with np.errstate(divide="ignore"):
            d = np.where(iscale == 0, 0, np.float32(1) / iscale).astype(np.float32)
        sums = q.reshape(m, k // 16, 16).astype(np.int32).sum(-1)
    else:
        xb = x.reshape(m, k // 32, 32)
        d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, 0, np.float32(1) / d).astype(np.float32)
        q = np.rint(xb * inv[..., None]).astype(np.int8)
        sums = q.astype(np.int32).sum(-1)
    return q.reshape(m, k), d, sums


def dequantized_activations(fmt: str, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    block = 256 if FORMATS[fmt] in K_QUANTS else 32
    m, k = q.shape
    return (q.reshape(m, k // block, block).astype(np.float64) * d[..., None]).reshape(m, k)


def residual(fmt: str, x: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """x - d * q in float32, as int8x2 quantizes it again."""
    block = 256 if FORMATS[fmt] in K_QUANTS else 32
    m, k = x.shape
    xb, qb = x.reshape(m, k // block, block), q.reshape(m, k // block, block).astype(np.float32)
    return (xb - d[..., None] * qb).reshape(m, k)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int8_activations_equal_an_independent_quantization(kq, fmt):
    k = 512
    x = np.random.default_rng(2).standard_normal((3, k)).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero block
    rq, rd, rsums = quantize_reference(fmt, x)
    want = (rq, rd, rsums, *quantize_reference(fmt, residual(fmt, x, rq, rd)))
    for isa in kq.isas:
        for got, ref in zip(kq.quantize_activations(fmt, torch.from_numpy(x), residual=True, isa=isa), want):
            assert np.array_equal(got.numpy(), ref), isa
        got = kq.quantize_activations(fmt, torch.from_numpy(x), isa=isa)
        assert len(got) == 3 and all(np.array_equal(a.numpy(), b) for a, b in zip(got, want)), isa


@pytest.mark.parametrize("fmt,n,k", [(f, 37, 512 if FORMATS[f] in K_QUANTS else 96) for f in FORMATS])
@pytest.mark.parametrize("m", [1, 6])
def test_gemm_equals_the_float64_product(kq, fmt, n, k, m):
    raw = random_blocks(fmt, n, k, seed=3)
    packed = kq.pack(fmt, torch.from_numpy(raw), n, k)
    w = reference(fmt, raw).astype(np.float64)
    big = torch.randn(m, k + 7)  # strided rows
    x = big[:, :k]
    bias = torch.randn(n)
    xc = x.contiguous().numpy()
    rq, rd, _ = quantize_reference(fmt, xc)
    xq = dequantized_activations(fmt, rq, rd)
    xq2 = dequantized_activations(fmt, *quantize_reference(fmt, residual(fmt, xc, rq, rd))[:2])
    b = bias.double().numpy()
    # mode -> (the product it must equal, the activations' two sets of |values| it sums over)
    wants = {"int8": (xq @ w.T + b, np.abs(xq)), "int8x2": ((xq + xq2) @ w.T + b, np.abs(xq) + np.abs(xq2)),
             "float": (xc.astype(np.float64) @ w.T + b, np.abs(xc))}
    for isa in kq.isas:
        got = {}
        for act, (want, ax) in wants.items():
            got[act] = kq.linear(x, fmt, packed, n, k, bias, act=act, isa=isa).double().numpy()
            # float32 rounding of the per-block sums: K * eps * sum |w x| (+ the bias)
            tol = 2 * k * EPS32 * (ax @ np.abs(w).T + np.abs(b))
            assert np.all(np.abs(got[act] - want) <= tol), (isa, act, np.abs(got[act] - want).max())
        exact = wants["float"][0]
        err8, err_x2 = (np.abs(got[act] - exact).mean() for act in ("int8", "int8x2"))
        assert err_x2 < err8 / 20, (isa, err8, err_x2)


def test_bad_inputs_say_what_is_wrong(kq):
    with pytest.raises(ValueError, match="whole blocks of 256"):
        kq.pack("Q6_K", torch.zeros(2, 210, dtype=torch.uint8), 2, 300)
    with pytest.raises(ValueError, match="not served"):
        kq.pack("Q4_0", torch.zeros(2, 18, dtype=torch.uint8), 2, 32)
    packed = kq.pack("Q6_K", torch.from_numpy(random_blocks("Q6_K", 2, 256)), 2, 256)
    with pytest.raises(IndexError):
        kq.dequantize("Q6_K", packed, 2, 256, torch.tensor([2]))
    with pytest.raises(ValueError, match="float32"):
        kq.linear(torch.zeros(1, 256, dtype=torch.float64), "Q6_K", packed, 2, 256)
