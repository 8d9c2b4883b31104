"""The Triton kernels of the GGUF types kept in the file's blocks (kernels/gguf/triton_kquants.py: Q2_K, Q3_K,
Q5_K, Q6_K, IQ4_XS, Q5_0, Q5_1, IQ4_NL), on CPU under TRITON_INTERPRET=1, at tiny shapes, against gguf-py:

- every dequantized tensor (whole, or rows gathered by id as the embedding does) equals gguf-py's
  `gguf.quants.dequantize` bit for bit, on random blocks and on tensors llama.cpp's quantizer wrote;
- the GEMV (one and two rows) and dequantize + GEMM (more) equal float64 dequantize-then-matmul within
  float32 rounding, also when writing into columns of a wider output.
The engine through these kernels is checked in test_gguf_kquant_model.py."""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import nanoplug.kernels.gguf.triton_kquants as kernels  # noqa: E402
from test_kquant_kernels import llama_cpp_tensors, random_blocks, reference  # noqa: E402

kernels = importlib.reload(kernels)
ROWS = 37
COLS = {fmt: 512 if per == 256 else 96 for fmt, (per, _) in kernels.BLOCK_BYTES.items()}


def weight(fmt: str, seed: int = 0):
    raw = random_blocks(fmt, ROWS, COLS[fmt], seed)
    return kernels.raw_blocks(fmt, torch.from_numpy(raw), ROWS, COLS[fmt]), torch.from_numpy(reference(fmt, raw))


@pytest.mark.parametrize("fmt", list(kernels.FORMATS))
def test_dequantize_equals_gguf_py(fmt):
    w, ref = weight(fmt)
    assert torch.equal(kernels.dequantize(w, torch.empty(ROWS, COLS[fmt])).view(torch.int32), ref.view(torch.int32))
    ids = torch.tensor([5, 0, 36, 5, 17])
    assert torch.equal(kernels.dequantize(w, torch.empty(len(ids), COLS[fmt]), ids), ref[ids])


def test_dequantize_llama_cpp_tensors_equals_gguf_py():
    for fmt, raws in llama_cpp_tensors().items():
        if fmt in kernels.FORMATS:
            raw = raws[0][:8]
            ref = torch.from_numpy(reference(fmt, raw))
            w = kernels.raw_blocks(fmt, torch.from_numpy(np.ascontiguousarray(raw)), 8, ref.shape[1])
            assert torch.equal(kernels.dequantize(w, torch.empty(8, ref.shape[1])), ref), fmt


@pytest.mark.parametrize("fmt", list(kernels.FORMATS))
@pytest.mark.parametrize("m", [1, 2, 5])  # the GEMV (one and two rows), dequantize + mm
def test_matmul_equals_dequantize_then_matmul(fmt, m):
    w, ref = weight(fmt, seed=1)
    x = torch.randn(m, COLS[fmt], generator=torch.Generator().manual_seed(2))
    out = torch.full((m, ROWS + 6), 7.0)
    got = kernels.linear(x, w, out[:, 3:3 + ROWS])
    exact = x.double() @ ref.double().T
    bound = 1e-5 * (x.double().abs() @ ref.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all(), (got.double() - exact).abs().max()
    assert (out[:, :3] == 7).all() and (out[:, 3 + ROWS:] == 7).all()


@pytest.mark.parametrize("fmt", ["Q6_K", "Q5_0"])
def test_the_experts_gemv_equals_each_experts_own(fmt):
    """Three experts' blocks stacked into one weight: each (token, slot) pair's row, reading its expert by id on the
    device, has the bits of that expert's own GEMV on its token (x_div: the pairs of one token share its row)."""
    experts = [random_blocks(fmt, ROWS, COLS[fmt], seed) for seed in (3, 4, 5)]
    stacked = kernels.raw_blocks(fmt, torch.from_numpy(np.concatenate(experts)), 3 * ROWS, COLS[fmt])
    x = torch.randn(2, COLS[fmt], generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([2, 0, 1, 2])  # token 0 takes experts 2 and 0, token 1 experts 1 and 2
    got = kernels.gemv(x, stacked, torch.empty(4, ROWS), experts=(ids, 2))
    for pair, expert in enumerate(ids.tolist()):
        own = kernels.raw_blocks(fmt, torch.from_numpy(experts[expert]), ROWS, COLS[fmt])
        assert torch.equal(got[pair], kernels.gemv(x[pair // 2:pair // 2 + 1], own, torch.empty(1, ROWS))[0])
