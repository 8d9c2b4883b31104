"""The Triton paged-decode kernel (triton_decode.py) on the GPU, over a float8 cache and over a bfloat16 one:
against float32 attention over the same cache for decode batches of 1, 7, 64 and 256 with mixed context
lengths and several split counts, and, over bfloat16, against FlashAttention-4's own decode on the same
inputs (the path `flash` replaces with it on Hopper). The engine-level comparison of `flash` against
`manual`, eager and under graphs: test_gpu_backends.py.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_decode_kernel.py`."""
from __future__ import annotations

import pytest
import torch

from nanoplug.api import AttentionSpec
from nanoplug.kernels.attention import rotated_cache, triton_decode
from nanoplug.plugins.attention import flash
from nanoplug.plugins.kv_cache import fp8

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
SHAPES = dict(argvalues=[(16, 8, 128, 256), (16, 8, 128, 128), (9, 3, 64, 16)],
              ids=["qwen3-0.6b-page256", "qwen3-0.6b-page128", "smollm2-page16"])


def _decode_inputs(batch, heads, kv_heads, dim, page, max_len, cache_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[0] = max_len  # the longest possible, and a page edge
    per = (lens + page - 1) // page
    width = int(per.max()) + 1  # padded with the scratch block
    num_blocks = int(per.sum()) + 1
    scratch = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=g)
    tables = torch.full((batch, width), scratch, dtype=torch.int32)
    at = 0
    for b in range(batch):
        m = int(per[b])
        tables[b, :m] = perm[at:at + m].int()
        at += m
    kc = (torch.randn(num_blocks, page, kv_heads, dim, generator=g) * 2).to(cache_dtype)
    vc = torch.randn(num_blocks, page, kv_heads, dim, generator=g).to(cache_dtype)
    q = torch.randn(batch, heads, dim, generator=g).bfloat16()
    return [t.cuda() for t in (q, kc, vc, tables, lens.int())]


def _reference(q, kc, vc, tables, lens, scale, ks, vs):
    """float32 attention of each sequence's query over its cached tokens (dequantized when float8)."""
    heads, kv_heads, page = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, : (n + page - 1) // page].long()
        bits = torch.uint8 if kc.dtype == FP8 else torch.int16  # indexing through an integer view: float8 has none
        k, v = (c.view(bits)[blocks].view(c.dtype).flatten(0, 1)[:n] for c in (kc, vc))
        if kc.dtype == FP8:
            k, v = fp8.dequantize(k, ks, torch.float32), fp8.dequantize(v, vs, torch.float32)
        k = k.float().repeat_interleave(heads // kv_heads, 1)
        v = v.float().repeat_interleave(heads // kv_heads, 1)
        p = ((q[b].float().unsqueeze(1) @ k.permute(1, 2, 0)) * scale).softmax(-1)  # [H, 1, n]
        out[b] = (p @ v.transpose(0, 1)).squeeze(1)
    return out


@pytest.mark.parametrize("cache_dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("shape", **SHAPES)
def test_decode_kernel_matches_float32_reference(batch, shape, cache_dtype):
    heads, kv_heads, dim, page = shape
    q, kc, vc, tables, lens = _decode_inputs(batch, heads, kv_heads, dim, page, 2048, cache_dtype)
    scaled = cache_dtype == FP8
    ks, vs = (torch.tensor(0.9, device="cuda"), torch.tensor(1.3, device="cuda")) if scaled else (None, None)
    cfg = triton_decode.DecodeConfig()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ref = _reference(q, kc, vc, tables, lens, dim ** -0.5, ks, vs)
    for splits in sorted({1, 5, triton_decode.num_splits(batch, kv_heads, 4096, sms, cfg)}):
        out = triton_decode.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, splits, ks, vs, cfg)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2, msg=f"splits={splits}")


@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("shape", **SHAPES)
def test_fp8_decode_turns_a_hadamard_basis_in_the_kernel_as_the_gemms_do(batch, shape):
    """The fast path against the plain one over a cache kept in the fp8 store's basis (Sylvester's Hadamard
    matrix, bf16): q and the output turned by the kernel's butterflies, and by two GEMMs around it; both
    against float32 attention of q R over the cache, turned back."""
    heads, kv_heads, dim, page = shape
    q, kc, vc, tables, lens = _decode_inputs(batch, heads, kv_heads, dim, page, 2048, FP8)
    ks, vs = torch.tensor(0.9, device="cuda"), torch.tensor(1.3, device="cuda")
    rot = fp8.hadamard(dim).cuda().bfloat16()
    assert rotated_cache.is_hadamard(rot)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = triton_decode.num_splits(batch, kv_heads, 4096, sms, triton_decode.DecodeConfig())
    ref = _reference(q.float() @ rot.float(), kc, vc, tables, lens, dim ** -0.5, ks, vs) @ rot.float().T
    for s in sorted({1, splits}):
        fused = triton_decode.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, s, ks, vs, rotation=rot,
                                           hadamard=True).float()
        gemms = triton_decode.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, s, ks, vs, rotation=rot).float()
        assert not fused.isnan().any()
        torch.testing.assert_close(fused, ref, atol=2e-2, rtol=2e-2, msg=f"splits={s}")
        torch.testing.assert_close(fused, gemms, atol=2e-2, rtol=2e-2, msg=f"splits={s}")
        # the kernel's turning rounds once less (float32 in registers, not a bf16 GEMM output): no farther
        assert (fused - ref).abs().max() <= (gemms - ref).abs().max() * 1.5 + 1e-3


@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("shape", **SHAPES)
def test_split_decode_matches_flash_attention_4(batch, shape):
    """The fast path against the plain one: the split kernel and FA4's decode, same bf16 inputs."""
    cute = pytest.importorskip("flash_attn.cute.interface", reason="FlashAttention-4 runs in the FA4 process")
    heads, kv_heads, dim, page = shape
    q, kc, vc, tables, lens = _decode_inputs(batch, heads, kv_heads, dim, page, 2048, torch.bfloat16)
    scale = dim ** -0.5
    theirs = cute.flash_attn_varlen_func(q.unsqueeze(1), kc, vc, seqused_k=lens, page_table=tables,
                                         softmax_scale=scale, causal=True)
    theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).squeeze(1).float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = triton_decode.num_splits(batch, kv_heads, 4096, sms, triton_decode.DecodeConfig())
    ours = triton_decode.paged_decode(q, kc, vc, tables, lens, scale, splits).float()
    ref = _reference(q, kc, vc, tables, lens, scale, None, None)
    # each rounds its float32 result to bf16 once: within two bf16 half-ulps of each other
    torch.testing.assert_close(ours, theirs, atol=1e-2, rtol=1e-2)
    assert (ours - ref).abs().max() <= (theirs - ref).abs().max() * 2 + 2e-3  # as close to float32 as FA4


def test_flash_decodes_by_the_split_kernel_on_hopper():
    kernels, errors = flash.load_kernels()
    assert kernels is not None, errors
    backend = flash.FlashAttention(AttentionSpec(16, 8, 128, 128 ** -0.5, 256, torch.bfloat16, torch.device("cuda")))
    hopper_fa4 = kernels.name == "FA4" and torch.cuda.get_device_capability()[0] == 9
    assert (backend.split_decode is not None) == hopper_fa4
