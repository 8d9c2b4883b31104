"""The CUDA platform's Triton kernels for the small ops (nanoplug/kernels/cuda/fused_ops.py), on CPU through
the Triton interpreter, against the layer library's plain ops on the same inputs: RMSNorm over 2-D rows and over
the heads of a strided [T, H, D] view (Qwen3's q/k norms), add + RMSNorm (both outputs), SiLU-and-mul with a
width that is not a power of two, and RoPE on strided q and k, in float32 (within float32 noise) and bfloat16
(within one rounding step: the interpreter truncates float32 to bfloat16 where a GPU rounds to nearest, so
bit equality can only be asked of float32 here); layouts they do not take go to the plain ops; and a whole
Qwen3 engine with them installed equals the plain one without a single fallback.

The kernels run under the interpreter for this module's tests only (tests/_triton_interpreter.py).
"""
from __future__ import annotations

import pytest
import torch

from _triton_interpreter import interpreted
from nanoplug.api import add_rms_norm, apply_rope, rms_norm, silu_and_mul


@pytest.fixture(scope="module")
def kernels():
    import nanoplug.kernels.cuda.fused_ops as module

    with interpreted(module) as reloaded:
        yield reloaded


def tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


def data(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_and_strided_heads(kernels, dtype):
    x, w = data(5, 96, dtype=dtype), data(96, dtype=dtype, seed=1)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), **tolerance(dtype))
    qkv = data(7, (4 + 2 * 2) * 16, dtype=dtype, seed=2)
    q = qkv[:, :64].view(7, 4, 16)  # a view of a wider projection: token stride 128, head stride 16
    wq = data(16, dtype=dtype, seed=3)
    got = kernels.rms_norm(q, wq, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm(q, wq, 1e-6), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_gives_the_sum_and_its_norm(kernels, dtype):
    x, res, w = data(6, 80, dtype=dtype), data(6, 80, dtype=dtype, seed=1), data(80, dtype=dtype, seed=2)
    out, summed = kernels.add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_summed = add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(summed, ref_summed, **tolerance(dtype))  # one rounding of the same sum
    if dtype == torch.float32:
        assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))


def test_the_float32_residual_stream_of_a_bf16_model(kernels):
    """A bf16 x added to a float32 residual (the first layer: the float32 stream alone) is summed and kept in
    float32, and its norm rounded once to bf16, as the plain ops do (within the interpreter's truncation)."""
    x, res = data(6, 80, dtype=torch.bfloat16), data(6, 80, dtype=torch.float32, seed=1)
    w = data(80, dtype=torch.bfloat16, seed=2)
    out, summed = kernels.add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_summed = add_rms_norm(x, res, w, 1e-5)
    assert summed.dtype == torch.float32 and out.dtype == torch.bfloat16 and ref_out.dtype == torch.bfloat16
    assert torch.equal(summed, ref_summed) and torch.equal(summed, x.float() + res)
    torch.testing.assert_close(out, ref_out, **tolerance(torch.bfloat16))
    got = kernels.rms_norm(res, w, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, rms_norm(res, w, 1e-5), **tolerance(torch.bfloat16))
    exact = torch.nn.functional.rms_norm(res, (80,), w.float(), 1e-5)  # one rounding of the float32 norm
    assert (got.float() - exact).abs().le(exact.abs() * 2 ** -7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(kernels, dtype):
    x = data(4, 2 * 3000, dtype=dtype)  # 3000: three programs of 1,024 columns a row, the last partly masked
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul(x), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_strided_q_and_k(kernels, dtype):
    t, heads, kv_heads, dim, max_pos = 5, 4, 2, 32, 64
    qkv = data(t, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = qkv[:, :heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.tensor([0, 7, 63, 7, 30])
    got_q, got_k = kernels.apply_rope(positions, q, k, cos, sin)
    ref_q, ref_k = apply_rope(positions, q, k, cos, sin)
    torch.testing.assert_close(got_q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(got_k, ref_k, **tolerance(dtype))


def test_layouts_the_kernels_do_not_take_go_to_the_plain_ops(kernels):
    x, w = data(3, 32, dtype=torch.bfloat16), data(32, dtype=torch.float32)
    got = kernels.rms_norm(x, w, 1e-6)  # a weight of another dtype: the plain result is float32
    assert got.dtype == torch.float32 and torch.equal(got, rms_norm(x, w, 1e-6))
    x4 = data(2, 3, 4, 32, dtype=torch.float32)  # 4-D
    assert torch.equal(kernels.rms_norm(x4, w, 1e-6), rms_norm(x4, w, 1e-6))
    assert torch.equal(kernels.silu_and_mul(x4), silu_and_mul(x4))


def test_a_model_with_the_kernels_installed_equals_the_plain_model_and_never_falls_back(kernels, monkeypatch):
    """Qwen3 (q/k norms on strided head views, RoPE, add + RMSNorm, SiLU-and-mul) on a test platform that
    installs these kernels as the cuda platform does: the same logits as the plain ops, and not one call of
    the decoders' layouts taken by a plain op (a silent fallback would cost the GPU its fused kernels)."""
    from _checkpoints import PROMPTS, checkpoint
    from _test_platforms import registry_with_platform
    from nanoplug import LLM, SamplingParams
    from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

    class TritonOpsOnCpu(CpuPlatform):
        description = "test-only: the cuda platform's Triton small-op kernels, under the interpreter"

        def prepare_model(self, model):
            model.install_fused_ops(kernels.fused_ops())

    def no_fallback(*args, **kwargs):
        raise AssertionError("a decoder layout went to the plain op")

    for name in ("plain_rms_norm", "plain_add_rms_norm", "plain_silu_and_mul", "plain_apply_rope"):
        monkeypatch.setattr(kernels, name, no_fallback)
    registry = registry_with_platform("cpu_triton_ops", TritonOpsOnCpu)
    options = dict(device="cpu", dtype="float32", attention="sdpa", kv_cache="torch", max_model_len=128,
                   cpu={"kernels": False, "graphs": False}, registry=registry)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_logits=True)
    plain = LLM(checkpoint(), **options).generate(PROMPTS[:2], params, use_tqdm=False)
    fused = LLM(checkpoint(), platform="cpu_triton_ops", **options).generate(PROMPTS[:2], params, use_tqdm=False)
    for a, b in zip(plain, fused, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
