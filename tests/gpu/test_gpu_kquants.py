"""The Triton kernels of the GGUF types kept in the file's blocks (kernels/gguf/triton_kquants.py) on CUDA, at
realistic shapes, against gguf-py's dequantization: dequantize (whole, rows by id, in bfloat16) and the
GEMV / dequantize + GEMM in bfloat16 against dequantize-then-matmul; the blocks are random bytes (every bit
pattern) and the tensors llama.cpp's quantizer wrote (tests/data/llama_cpp_quants.gguf).

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_kquants.py`."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared helpers in tests/

from _gguf_files import random_blocks  # noqa: E402
from nanoplug.kernels.gguf import triton_kquants as kernels  # noqa: E402

pytestmark = pytest.mark.gpu
ROWS, COLS = 1000, 4096  # rows not a multiple of any tile
DATA = Path(__file__).resolve().parent.parent / "data" / "llama_cpp_quants.gguf"


def weight(fmt: str, seed: int = 0, rows: int = ROWS, cols: int = COLS):
    raw = random_blocks(fmt, rows, cols, seed)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(rows, cols)
    w = kernels.raw_blocks(fmt, torch.from_numpy(raw), rows, cols).to(torch.device("cuda"))
    return w, torch.from_numpy(ref).cuda()


@pytest.mark.parametrize("fmt", list(kernels.FORMATS))
def test_dequantize_on_cuda(fmt):
    w, ref = weight(fmt)
    got = kernels.dequantize(w, torch.empty(ROWS, COLS, device="cuda"))
    # products are exact; a multiply-add (Q2_K, Q5_K, Q5_1) may be fused into one FMA on the GPU: 1 ulp
    torch.testing.assert_close(got, ref, rtol=2.4e-7, atol=1e-9)
    ids = torch.tensor([5, 0, 999, 5], device="cuda")
    bf = kernels.dequantize(w, torch.empty(4, COLS, dtype=torch.bfloat16, device="cuda"), ids)
    assert torch.equal(bf, got[ids].to(torch.bfloat16))


def test_llama_cpp_tensors_on_cuda():
    for t in gguf.GGUFReader(str(DATA)).tensors:
        fmt = t.tensor_type.name
        if fmt not in kernels.FORMATS:
            continue
        raw = np.ascontiguousarray(np.asarray(t.data).reshape(int(t.shape[1]), -1))
        rows, cols = raw.shape[0], int(t.shape[0])
        ref = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type).reshape(rows, cols)).cuda()
        w = kernels.raw_blocks(fmt, torch.from_numpy(raw), rows, cols).to(torch.device("cuda"))
        torch.testing.assert_close(kernels.dequantize(w, torch.empty(rows, cols, device="cuda")), ref,
                                   rtol=2.4e-7, atol=1e-9)


@pytest.mark.parametrize("fmt", list(kernels.FORMATS))
@pytest.mark.parametrize("m", [1, 2, 16, 300])  # decode: the GEMV; more rows: dequantize + mm
def test_matmul_bf16_on_cuda(fmt, m):
    w, ref = weight(fmt, seed=1)
    x = torch.randn(m, COLS, device="cuda").to(torch.bfloat16)
    got = kernels.linear(x, w, torch.empty(m, ROWS, dtype=torch.bfloat16, device="cuda")).float()
    want = x.float() @ ref.T
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel  # bfloat16 output (and, past the GEMV, bfloat16 weights): 2^-9 relative each
