"""Every attention backend and KV store on CUDA in bf16, against the plain ones on identical inputs
(`nanoplug compare`'s scenario: prefill, decode, prefix-cache hits, chunked prefill), decode under
CUDA graphs + fused small-op kernels against eager, and the Triton store against the torch store.

Run on the GPU machine: `pytest -m gpu tests/gpu`, once with flash_attn.cute importable and once
without (xformers 0.0.35 cannot import beside it); in each run the backend that cannot load must
say why, naming the fix, and every other one must match."""
from __future__ import annotations

import pytest
import torch

from _two_processes import fa4_importable
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.cli import compare

pytestmark = pytest.mark.gpu
BF16_REL_TOL = 2e-2
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    return str(write_random_checkpoint(tmp_path_factory.mktemp("gpu") / "q3", **GPU_SHAPE))


@pytest.fixture(scope="session")
def reference(model):
    outcome = compare.run_backend(model, "manual", device="cuda", dtype="bfloat16", cuda={"enforce_eager": True})
    assert outcome.error is None, outcome.error
    return outcome


def check_close(outcome, reference):
    diffs = compare.differences(outcome, reference)
    assert set(diffs) == {"prefill", "decode", "prefix-hit", "chunked", "decode-mixed"}
    for case, (abs_diff, rel_diff) in diffs.items():
        assert rel_diff < BF16_REL_TOL, (outcome.name, case, abs_diff, rel_diff)


@pytest.mark.parametrize("name", ["flash", "xformers", "sdpa"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_attention_matches_manual(model, reference, name, eager):
    outcome = compare.run_backend(model, name, device="cuda", dtype="bfloat16", cuda={"enforce_eager": eager})
    if name == "flash" and not fa4_importable() and outcome.error:
        assert "pip install flash-attn" in outcome.error  # no FlashAttention build here: the reason names the fix
        return
    if name == "xformers" and fa4_importable():
        assert outcome.error and "xformers does not import" in outcome.error  # a reason, not a crash
        return
    assert outcome.error is None, outcome.error
    check_close(outcome, reference)


def test_triton_store_cuda_matches_torch(model, reference):
    outcome = compare.run_backend(model, "triton", "kv_cache", device="cuda", dtype="bfloat16",
                                  attention="manual", cuda={"enforce_eager": True})
    assert outcome.error is None, outcome.error
    assert all(d[0] == 0.0 for d in compare.differences(outcome, reference).values())  # a copy: exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_store_kernel_exact(dtype):
    from nanoplug.plugins.kv_cache.torch import TorchStore
    from nanoplug.api import KVLayer
    from nanoplug.plugins.kv_cache.triton import TritonStore

    torch.manual_seed(0)
    n, heads, dim = 300, 8, 128
    qkv = torch.randn(n, 32 * dim, device="cuda", dtype=dtype)
    k = qkv[:, 16 * dim:24 * dim].view(n, heads, dim)
    v = qkv[:, 24 * dim:].view(n, heads, dim)
    slots = torch.randperm(40 * 16, device="cuda")[:n]
    slots[::7] = -1
    kc = torch.randn(40, 16, heads, dim, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    rk, rv = kc.clone(), vc.clone()
    keep = slots >= 0
    layer = KVLayer(0)
    TorchStore().store(k[keep], v[keep], rk, rv, slots[keep], layer)
    TritonStore().store(k, v, kc, vc, slots, layer)
    torch.cuda.synchronize()
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
