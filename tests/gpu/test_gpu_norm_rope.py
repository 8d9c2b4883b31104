"""The one-launch q/k norms + RoPE kernel on the GPU, against the plain ops there (rms_norm on q and k, then
apply_rope, torch's own CUDA kernels): bit for bit on inputs whose sums of squares are exact in any order (so
every rounding of the chain is compared: the rotation's multiply then add, not an FMA, included), for float32,
bfloat16 and float16, with and without the norms; and a token's result is the same at batch 1 as in a batch
of 256 (the kernel's blocks do not depend on the batch).

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_norm_rope.py`."""
from __future__ import annotations

import pytest
import torch

from nanoplug.api import apply_rope, rms_norm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    import nanoplug.kernels.cuda.fused_ops as module

    if not torch.cuda.is_available() or module.triton is None:
        pytest.skip("needs CUDA and triton")
    return module


def inputs(t, heads, kv_heads, dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = (torch.randint(-16, 17, (t, (heads + 2 * kv_heads) * dim), device="cuda", generator=g) / 4).to(dtype)
    q = qkv[:, :heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
    q_w = torch.empty(dim, device="cuda").uniform_(0.5, 1.5, generator=g).to(dtype)
    k_w = torch.empty(dim, device="cuda").uniform_(-1.5, 1.5, generator=g).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    emb = torch.outer(torch.arange(40960, device="cuda").float(), inv_freq).repeat(1, 2)
    positions = torch.randint(0, 40960, (t,), device="cuda", generator=g)
    return positions, q, k, emb.cos(), emb.sin(), q_w, k_w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t,heads,kv_heads,dim", [(1, 16, 8, 128), (256, 16, 8, 128), (77, 8, 2, 64), (9, 4, 4, 256)])
def test_bit_for_bit_the_plain_ops_on_the_gpu(kernels, dtype, norm, t, heads, kv_heads, dim):
    positions, q, k, cos, sin, q_w, k_w = inputs(t, heads, kv_heads, dim, dtype)
    if not norm:
        q_w = k_w = None
    got = kernels.norm_rope(positions, q, k, cos, sin, q_w, k_w, 1e-6)
    if norm:
        q, k = rms_norm(q, q_w, 1e-6), rms_norm(k, k_w, 1e-6)
    ref = apply_rope(positions, q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_token_gets_the_same_result_at_any_batch_size(kernels):
    positions, q, k, cos, sin, q_w, k_w = inputs(256, 16, 8, 128, torch.bfloat16)
    q, k = torch.randn_like(q, dtype=torch.float32).bfloat16(), torch.randn_like(k, dtype=torch.float32).bfloat16()
    whole = kernels.norm_rope(positions, q, k, cos, sin, q_w, k_w, 1e-6)
    for i in (0, 131, 255):
        one = kernels.norm_rope(positions[i:i + 1], q[i:i + 1], k[i:i + 1], cos, sin, q_w, k_w, 1e-6)
        assert torch.equal(one[0][0], whole[0][i]) and torch.equal(one[1][0], whole[1][i])
