"""Sliding-window attention in the kernels, against float32 attention over the window alone: the Triton
decode kernel under TRITON_INTERPRET=1 (pages wholly before the window are the NaN scratch page, as the
engine's tables have them once those blocks are freed, so a tile it read there would show), and the
per-window masks of sdpa's CPU decode. (The interpreter is set before the kernels are defined.)"""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import nanoplug.kernels.attention.triton_decode as triton_decode  # noqa: E402
import nanoplug.plugins.kv_cache.fp8 as fp8  # noqa: E402
from nanoplug.api import AttentionMetadata, AttentionSpec, KVLayer  # noqa: E402
from nanoplug.kernels.attention.paged_decode import PagedDecode  # noqa: E402

fp8 = importlib.reload(fp8)
triton_decode = importlib.reload(triton_decode)
FP8 = torch.float8_e4m3fn
PAGE = 16


def reference(q, k_cache, v_cache, tables, seq_lens, scale, window, k_scale=None, v_scale=None):
    """float32 attention of each sequence's one query over the last `window` keys of its context."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, n in enumerate(seq_lens.tolist()):
        first = max(0, n - window) if window else 0
        blocks = tables[b, : (n + PAGE - 1) // PAGE].long()
        k, v = k_cache[blocks].flatten(0, 1)[first:n], v_cache[blocks].flatten(0, 1)[first:n]
        if k_scale is not None:
            k, v = fp8.dequantize(k, k_scale, torch.float32), fp8.dequantize(v, v_scale, torch.float32)
        k = k.float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        v = v.float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        p = ((q[b].float().unsqueeze(1) @ k.transpose(1, 2)) * scale).softmax(-1)
        out[b] = (p @ v).squeeze(1)
    return out


def windowed_case(seq_lens, window, cache_dtype, heads=6, kv_heads=2, dim=32, seed=0, scratch_value=float("nan")):
    """Paged caches whose pages wholly before each sequence's window are the scratch page, full of NaN (the
    engine zeroes it: the gathering paths read it, masked, and need it finite; the Triton kernel never does)."""
    g = torch.Generator().manual_seed(seed)
    width = max((n + PAGE - 1) // PAGE for n in seq_lens) + 1
    num_blocks = len(seq_lens) * width + 1
    scratch = num_blocks - 1
    tables = torch.full((len(seq_lens), width), scratch, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=g)
    for b, n in enumerate(seq_lens):
        first_live = max(0, n - window) // PAGE  # pages before it hold no key of the window: freed
        for j in range(first_live, (n + PAGE - 1) // PAGE):
            tables[b, j] = perm[b * width + j]
    k_cache = (torch.randn(num_blocks, PAGE, kv_heads, dim, generator=g) * 2).to(cache_dtype)
    v_cache = (torch.randn(num_blocks, PAGE, kv_heads, dim, generator=g) * 2).to(cache_dtype)
    nan = torch.tensor(scratch_value).to(cache_dtype)
    k_cache[scratch], v_cache[scratch] = nan, nan
    q = torch.randn(len(seq_lens), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("window", [5, 16, 40])
@pytest.mark.parametrize("splits,block_n", [(1, 8), (3, 8), (2, 32)])  # tiles within pages, and across them
def test_triton_decode_attends_over_the_window_only(cache_dtype, window, splits, block_n):
    seq_lens = [1, 5, 17, 64, 100, 131]
    q, kc, vc, tables, lens = windowed_case(seq_lens, window, cache_dtype)
    scales = (torch.tensor(0.8), torch.tensor(1.7)) if cache_dtype == FP8 else (None, None)
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, splits, *scales,
                                     triton_decode.DecodeConfig(block_n=block_n), window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference(q, kc, vc, tables, lens, 0.125, window, *scales), rtol=1e-5, atol=1e-5)


def test_triton_decode_without_a_window_still_reads_everything():
    q, kc, vc, tables, lens = windowed_case([3, 40, 77], 10 ** 6, torch.float32)
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, 2, cfg=triton_decode.DecodeConfig(block_n=16))
    torch.testing.assert_close(out, reference(q, kc, vc, tables, lens, 0.125, None), rtol=1e-5, atol=1e-5)


def test_sdpa_cpu_decode_masks_each_layer_by_its_own_window():
    """One step, two layers: a local one (window 12) and a global one, each against its reference."""
    seq_lens = [7, 30, 65]
    q, kc, vc, tables, lens = windowed_case(seq_lens, 10 ** 6, torch.float32, dim=16, scratch_value=0.0)
    spec = AttentionSpec(6, 2, 16, 0.25, PAGE, torch.float32, torch.device("cpu"), sliding_windows=(12, None))
    n = len(seq_lens)
    meta = AttentionMetadata(False, torch.arange(n + 1, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32),
                             lens, torch.zeros(n, dtype=torch.int64), tables, 1, max(seq_lens), [1] * n, seq_lens)
    decode = PagedDecode(spec)
    decode.prepare(meta)
    for layer, window in ((0, 12), (1, None)):
        out = decode.forward(q, kc, vc, KVLayer(layer))
        torch.testing.assert_close(out, reference(q, kc, vc, tables, lens, 0.25, window), rtol=1e-5, atol=1e-5)
