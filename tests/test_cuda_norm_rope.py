"""The CUDA platform's one-launch q/k norms + RoPE kernel (nanoplug/kernels/cuda/fused_ops.py `norm_rope`), on
CPU through the Triton interpreter, against the layer library's plain ops (rms_norm on q and on k, then
apply_rope): bit for bit in float32, bfloat16 and float16 on q and k viewed out of one qkv projection, at
batch 1 and more, head dims 64 and 128, grouped-query and not, with and without the norms. The inputs are
multiples of 1/4, so the sum of squares is exact in any order: every rounding of the chain is then compared,
and nothing rests on the order of a float32 sum, which no kernel shares with torch. The interpreter
truncates float32 to bfloat16 where a GPU rounds to nearest even; the fixture gives it the GPU's rounding.
Also: the layouts it does not take go to the plain ops; the RotaryEmbedding routes the norms through the fused
op only when one is installed; a whole Qwen3 and Qwen2 engine with the kernels gives the plain engine's tokens
and logits with one launch per layer.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _triton_interpreter import interpreted
from nanoplug.api import FusedOps, RMSNorm, RotaryEmbedding, apply_rope, install_fused_ops, rms_norm


def _round_to_nearest_even(original):
    import triton.language as tl

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(np.array(data, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    return convert


@pytest.fixture(scope="module")
def kernels():
    import triton.runtime.interpreter as interpreter

    import nanoplug.kernels.cuda.fused_ops as module

    with interpreted(module) as reloaded, pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_convert_float", _round_to_nearest_even(interpreter._convert_float))
        yield reloaded


def tables(dim: int, max_pos: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq).repeat(1, 2)
    return emb.cos(), emb.sin()


def inputs(t: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0, exact: bool = True):
    """q and k as views of one qkv projection (token stride (heads + 2 kv_heads) dim), weights and positions."""
    g = torch.Generator().manual_seed(seed)
    shape = (t, (heads + 2 * kv_heads) * dim)
    qkv = (torch.randint(-16, 17, shape, generator=g) / 4 if exact else torch.randn(shape, generator=g) * 3).to(dtype)
    q = qkv[:, :heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
    q_w = torch.empty(dim).uniform_(0.5, 1.5, generator=g).to(dtype)
    k_w = torch.empty(dim).uniform_(-1.5, 1.5, generator=g).to(dtype)
    return torch.randint(0, 512, (t,), generator=g), q, k, q_w, k_w


def plain(positions, q, k, q_w, k_w, eps=1e-6):
    if q_w is not None:
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    return apply_rope(positions, q, k, *tables(q.shape[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t,heads,kv_heads,dim", [(1, 16, 8, 128), (5, 6, 2, 64), (3, 4, 4, 64), (2, 2, 1, 128)])
def test_bit_for_bit_the_plain_norms_then_rope(kernels, dtype, norm, t, heads, kv_heads, dim):
    positions, q, k, q_w, k_w = inputs(t, heads, kv_heads, dim, dtype)
    if not norm:
        q_w = k_w = None
    got_q, got_k = kernels.norm_rope(positions, q, k, *tables(dim), q_w, k_w, 1e-6)
    ref_q, ref_k = plain(positions, q, k, q_w, k_w)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == got_k.dtype == dtype
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_data_and_a_head_dim_not_a_power_of_two_within_a_rounding(kernels, dtype):
    """Normal data (sums in another order than torch's) and head dim 96 (halves padded to 64)."""
    for dim in (96, 128):
        positions, q, k, q_w, k_w = inputs(4, 4, 2, dim, dtype, seed=dim, exact=False)
        got = kernels.norm_rope(positions, q, k, *tables(dim), q_w, k_w, 1e-6)
        tol = dict(rtol=1.6e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        for a, b in zip(got, plain(positions, q, k, q_w, k_w), strict=True):
            torch.testing.assert_close(a, b, **tol)


def test_q_and_k_of_their_own_tensors_and_int32_positions(kernels):
    positions, q, k, q_w, k_w = inputs(3, 4, 2, 64, torch.bfloat16)
    q, k = q.contiguous(), k.clone()
    got = kernels.norm_rope(positions.int(), q, k, *tables(64), q_w, k_w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, plain(positions, q, k, q_w, k_w), strict=True))


def test_layouts_it_does_not_take_go_to_the_plain_ops(kernels):
    positions, q, k, q_w, k_w = inputs(3, 4, 2, 64, torch.bfloat16)
    cos, sin = tables(64)
    wide = q_w.float()  # a weight of another dtype: the plain norm's result is float32
    got = kernels.norm_rope(positions, q, k, cos, sin, wide, k_w.float(), 1e-6)
    assert got[0].dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(got, plain(positions, q, k, wide, k_w.float()), strict=True))
    half_cos, half_sin = cos[:, :32].contiguous(), sin[:, :32].contiguous()  # partial rotary tables
    with pytest.raises(RuntimeError):  # the plain op's own error: the kernel never read past the table
        kernels.norm_rope(positions, q, k, half_cos, half_sin)


def test_the_rotary_routes_the_norms_through_the_fused_op_only_when_installed():
    cfg = type("Cfg", (), {"rope_theta": 10000.0})()
    rotary = RotaryEmbedding(cfg, 16, 64)
    q_norm, k_norm = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6)
    q_norm.weight.data.uniform_(0.5, 1.5)
    positions, q, k = torch.tensor([3, 9]), torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    ref = apply_rope(positions, rms_norm(q, q_norm.weight, 1e-6), rms_norm(k, k_norm.weight, 1e-6), rotary.cos,
                     rotary.sin)
    assert all(torch.equal(a, b) for a, b in zip(rotary(positions, q, k, q_norm, k_norm), ref, strict=True))
    calls = []
    ops = FusedOps(rms_norm=rms_norm, add_rms_norm=None, silu_and_mul=None, rope=apply_rope)
    install_fused_ops(rotary, ops)  # no norm_rope (the CPU platform's ops): norms then rope, as before
    assert rotary.fused_norm is None
    assert all(torch.equal(a, b) for a, b in zip(rotary(positions, q, k, q_norm, k_norm), ref, strict=True))

    def norm_rope(*args):
        calls.append(args)
        return args[1:3]

    install_fused_ops(rotary, FusedOps(rms_norm, None, None, apply_rope, norm_rope=norm_rope))
    rotary(positions, q, k, q_norm, k_norm)
    (args,) = calls
    assert args[5] is q_norm.weight and args[6] is k_norm.weight and args[7] == 1e-6


@pytest.mark.parametrize("name,qk_norm", [("qwen3", True), ("qwen2", False)])
def test_an_engine_with_the_kernels_gives_the_plain_engines_tokens_in_one_launch_a_layer(kernels, monkeypatch,
                                                                                          name, qk_norm):
    """Every layer's q/k norms and RoPE in one launch of the kernel (no head rows left to the rms_norm kernel,
    nothing to a plain op): the plain engine's tokens and logits (float32 sums in another order: within
    float32 noise)."""
    from _checkpoints import PROMPTS, checkpoint
    from _test_platforms import registry_with_platform
    from nanoplug import LLM, SamplingParams
    from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

    class TritonOpsOnCpu(CpuPlatform):
        description = "test-only: the cuda platform's Triton small-op kernels, under the interpreter"

        def prepare_model(self, model):
            model.install_fused_ops(kernels.fused_ops())

    launches, norm_rows = [], set()

    class Counted:
        def __init__(self, kernel, record):
            self.kernel, self.record = kernel, record

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.record(args, kwargs)
                return self.kernel[grid](*args, **kwargs)
            return launch

    def no_fallback(*args, **kwargs):
        raise AssertionError("a decoder layout went to a plain op")

    for plain_op in ("plain_rms_norm", "plain_apply_rope"):
        monkeypatch.setattr(kernels, plain_op, no_fallback)
    monkeypatch.setattr(kernels, "_norm_rope_kernel",
                        Counted(kernels._norm_rope_kernel, lambda args, kwargs: launches.append(kwargs["NORM"])))
    monkeypatch.setattr(kernels, "_rms_norm_kernel",  # rows per outer index: 1 for [T, N], H for heads
                        Counted(kernels._rms_norm_kernel, lambda args, kwargs: norm_rows.add(args[5])))
    registry = registry_with_platform("cpu_triton_norm_rope", TritonOpsOnCpu)
    options = dict(device="cpu", dtype="float32", attention="sdpa", kv_cache="torch", max_model_len=128,
                   cpu={"kernels": False, "graphs": False}, registry=registry)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_logits=True)
    plain_out = LLM(checkpoint(name), **options).generate(PROMPTS[:2], params, use_tqdm=False)
    assert not launches
    fused_out = LLM(checkpoint(name), platform="cpu_triton_norm_rope", **options).generate(PROMPTS[:2], params,
                                                                                         use_tqdm=False)
    assert launches and len(launches) % 2 == 0 and set(launches) == {qk_norm}  # two layers a step
    assert norm_rows == {1}
    for a, b in zip(plain_out, fused_out, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
