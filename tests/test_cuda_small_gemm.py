"""The CUDA platform's one- and two-row linear kernel (nanoplug/kernels/cuda/small_gemm.py), on CPU through the
Triton interpreter, against F.linear on the same inputs: one and two rows, K a multiple of the kernel's chunk and
not, N not a multiple of its row block, with and without bias, float32 (within float32 noise) and bfloat16
(within a rounding step); products it does not take go to F.linear unchanged; and a whole Qwen3 engine whose
decode runs through the kernel (batch 1 and 2) gives the plain engine's tokens and logits.

The kernel runs under the interpreter for this module's tests only (tests/_triton_interpreter.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _triton_interpreter import interpreted


@pytest.fixture(scope="module")
def gemm():
    import nanoplug.kernels.cuda.small_gemm as module

    with interpreted(module) as reloaded:
        yield reloaded


def data(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,bias", [(1, 37, 96, False), (2, 64, 2048, True), (1, 8, 1500, True),
                                           (2, 5, 3, False), (1, 5, 4500, False), (1, 3, 4096, True)])
def test_small_gemm_equals_f_linear(gemm, dtype, rows, n, k, bias):
    x, w = data(rows, k, dtype=dtype), data(n, k, dtype=dtype, seed=1)
    b = data(n, dtype=dtype, seed=2) if bias else None
    assert gemm.takes(x, w, b)
    got, want = gemm.linear(x, w, b), F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2 * k ** 0.5)
    torch.testing.assert_close(got.float(), want, **tol)


def test_strided_rows_of_x(gemm):
    """x a column slice of a wider tensor (row stride > K), as a fused projection's part may be."""
    wide, w = data(2, 80, dtype=torch.float32), data(9, 48, dtype=torch.float32, seed=1)
    x = wide[:, 16:64]
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_products_it_does_not_take_go_to_f_linear(gemm):
    w = data(16, 32, dtype=torch.float32)
    three = data(3, 32, dtype=torch.float32)  # three rows: cuBLAS is as fast
    assert not gemm.takes(three, w, None)
    assert torch.equal(gemm.linear(three, w), F.linear(three, w))
    assert not gemm.takes(data(1, 32, dtype=torch.bfloat16), w, None)  # dtypes differ
    # two rows of a big weight (a Qwen3-8B layer's, an LM head's): cuBLAS; one row of it: the kernel
    assert not gemm.takes(data(2, 32, dtype=torch.float32), data(1 << 17, 32, dtype=torch.float32), None)
    assert gemm.takes(data(1, 32, dtype=torch.float32), data(1 << 17, 32, dtype=torch.float32), None)
    assert not gemm.takes(data(1, 32, dtype=torch.float32).t(), data(16, 1, dtype=torch.float32), None)


def test_a_verifying_engine_takes_its_verification_rows_whatever_the_weight(gemm):
    """With drafts to verify (1 + k query rows a sequence, padded as the decode graphs pad them), a small weight's
    products of up to that many rows are the kernel's (a row's result then equals its one-row result); a big
    weight's keep the one-row rule, and an engine without drafts is as before."""
    from torch import nn

    assert [gemm.verify_rows(n) for n in (1, 2, 4, 5, 8, 9)] == [1, 2, 4, 8, 8, 1]
    small, big = data(64, 32, dtype=torch.float32), data(1 << 17, 32, dtype=torch.float32)
    for rows in (3, 5, 8):
        assert gemm.takes(data(rows, 32, dtype=torch.float32), small, None, verify=8)
        assert not gemm.takes(data(rows, 32, dtype=torch.float32), small, None)
        assert not gemm.takes(data(rows, 32, dtype=torch.float32), big, None, verify=8)
    assert not gemm.takes(data(9, 32, dtype=torch.float32), small, None, verify=8)
    layer = nn.Module()
    layer.weight = nn.Parameter(data(40, 48, dtype=torch.float32), requires_grad=False)
    x = data(5, 48, dtype=torch.float32, seed=3)
    method = gemm.SmallBatchLinearMethod(verify=8)
    together = method.apply(layer, x, None)
    assert torch.equal(together, torch.cat([method.apply(layer, x[i:i + 1], None) for i in range(5)]))
    assert gemm.SmallBatchLinearMethod().verify == 1


def test_the_method_keeps_leading_dims(gemm):
    from torch import nn

    layer = nn.Module()
    layer.weight = nn.Parameter(data(12, 32, dtype=torch.float32), requires_grad=False)
    x = data(1, 1, 32, dtype=torch.float32)
    got = gemm.SmallBatchLinearMethod().apply(layer, x, None)
    assert got.shape == (1, 1, 12)
    torch.testing.assert_close(got, F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)


def test_an_engine_decoding_through_the_kernel_equals_the_plain_engine(gemm, monkeypatch):
    """Qwen3 on a test platform whose linear method is the cuda platform's: decode of two sequences runs every
    linear layer (and the LM head) through the kernel, and the tokens and logits are the plain engine's. (Two
    decode steps: the interpreter runs the LM head's thousands of programs one by one.)"""
    from _checkpoints import PROMPTS, checkpoint
    from _test_platforms import registry_with_platform
    from nanoplug import LLM, SamplingParams
    from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

    calls = []
    kernel = gemm._small_gemm_kernel

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gemm, "_small_gemm_kernel", Counting())

    class SmallGemmOnCpu(CpuPlatform):
        description = "test-only: the cuda platform's small-batch linear kernel, under the interpreter"

        def linear_method(self):
            return gemm.SmallBatchLinearMethod()

    registry = registry_with_platform("cpu_small_gemm", SmallGemmOnCpu)
    options = dict(device="cpu", dtype="float32", attention="sdpa", kv_cache="torch", max_model_len=128,
                   cpu={"kernels": False, "graphs": False, "weight_packing": False}, registry=registry)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_logits=True)
    plain = LLM(checkpoint(), **options).generate(PROMPTS[:2], params, use_tqdm=False)
    fast = LLM(checkpoint(), platform="cpu_small_gemm", **options).generate(PROMPTS[:2], params, use_tqdm=False)
    assert calls, "decode never ran through the kernel"
    for a, b in zip(plain, fast, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_float32_logits_of_bf16_operands(gemm, rows):
    """The LM head's `apply_float32`: the kernel's float32 accumulators unrounded (one and two rows), else the
    widened product (three rows): both within float32 noise of the float32 product, where a bf16 result would
    be a rounding step away."""
    from torch import nn

    layer = nn.Module()
    layer.weight = nn.Parameter(data(40, 96, dtype=torch.bfloat16, seed=1), requires_grad=False)
    x = data(rows, 96, dtype=torch.bfloat16)
    got = gemm.SmallBatchLinearMethod().apply_float32(layer, x)
    want = F.linear(x.float(), layer.weight.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.equal(want, want.bfloat16().float())  # (so a bf16 rounding would have been caught)
