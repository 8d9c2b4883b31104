"""The fp8 KV cache on CPU through the Triton interpreter: the quantizing store against PyTorch's own
float8 rounding (bit-exact), the paged decode kernel against float32 attention over the dequantized
cache, and the KV cache's size. (TRITON_INTERPRET=1 must be set before the kernels are defined, so
their modules are reloaded after setting it, whatever another test imported first.)

The interpreter's own float32 -> float8 cast rounds some values wrong (7.84 becomes 4.0); the store
rounds in float32 arithmetic and casts only exact e4m3 values, so these tests cover the GPU's path."""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from nanoplug.api import KVLayer  # noqa: E402
from nanoplug.kernels.attention import rotated_cache  # noqa: E402
from nanoplug.kernels.attention.rotated_cache import RotatedKVLayer  # noqa: E402

import nanoplug.kernels.attention.dequantized_pages as dequantized_pages  # noqa: E402
import nanoplug.kernels.attention.triton_decode as triton_decode  # noqa: E402
import nanoplug.plugins.kv_cache.fp8 as fp8  # noqa: E402

fp8 = importlib.reload(fp8)
triton_decode = importlib.reload(triton_decode)
dequantized_pages = importlib.reload(dequantized_pages)
FP8 = torch.float8_e4m3fn


def _layer(k_scale=1.0, v_scale=1.0) -> KVLayer:
    return KVLayer(0, torch.tensor(k_scale), torch.tensor(v_scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_store_quantizes_exactly_as_torch(dtype, scales):
    torch.manual_seed(0)
    n, heads, dim = 9, 3, 64  # a row of 192 values: not a power of two
    qkv = torch.randn(n, (4 + 2 * heads) * dim, dtype=dtype) * 40  # some beyond 448 / scale: saturated
    qkv[0, :8] = torch.tensor([7.84, -7.84, 0.0, -0.0, 1e-4, 3e-3, 1e4, -1e4])  # ties, binade edges, subnormals
    _, k, v = qkv.split([4 * dim, heads * dim, heads * dim], dim=-1)  # strided views, as the model makes them
    k, v = k.view(n, heads, dim), v.view(n, heads, dim)
    slots = torch.tensor([0, 5, 6, 7, -1, 12, 13, 23, 3], dtype=torch.int64)
    kc = torch.full((6, 4, heads, dim), 1.0).to(FP8)
    vc = kc.clone()
    ref_k, ref_v = kc.clone(), vc.clone()
    layer = _layer(*scales)
    keep = slots >= 0
    ref_k.view(-1, heads, dim)[slots[keep]] = fp8.quantize_reference(k[keep], layer.k_scale)
    ref_v.view(-1, heads, dim)[slots[keep]] = fp8.quantize_reference(v[keep], layer.v_scale)
    fp8.Fp8Store().store(k, v, kc, vc, slots, layer)
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))  # bit-exact, slot -1 untouched
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    assert not kc.float().isnan().any()  # saturated, never NaN


def test_every_e4m3_value_and_midpoint_rounds_as_torch():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[~codes.isnan()].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # ties: to even
    x = torch.cat([finite, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    x = torch.cat([x, torch.zeros(-len(x) % 64)]).view(-1, 1, 64)
    slots = torch.arange(len(x))
    kc = torch.zeros(len(x), 1, 1, 64, dtype=FP8)
    vc = kc.clone()
    fp8.Fp8Store().store(x, -x, kc, vc, slots, _layer())
    assert torch.equal(kc.view(torch.uint8).flatten(), fp8.quantize_reference(x, torch.tensor(1.0)).view(torch.uint8).flatten())
    assert torch.equal(vc.view(torch.uint8).flatten(), fp8.quantize_reference(-x, torch.tensor(1.0)).view(torch.uint8).flatten())


def reference_decode(q, k_cache, v_cache, tables, seq_lens, scale, k_scale, v_scale):
    """float32 attention of each sequence's one query over its dequantized context."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    page = k_cache.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        blocks = tables[b, : (n + page - 1) // page].long()
        k = fp8.dequantize(k_cache[blocks].flatten(0, 1)[:n], k_scale, torch.float32)
        v = fp8.dequantize(v_cache[blocks].flatten(0, 1)[:n], v_scale, torch.float32)
        k = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [H, n, D]
        v = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        p = ((q[b].float().unsqueeze(1) @ k.transpose(1, 2)) * scale).softmax(-1)
        out[b] = (p @ v).squeeze(1)
    return out


def _decode_case(seq_lens, heads=6, kv_heads=2, dim=64, page=16, width=None, cache_dtype=FP8, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_needed = sum((n + page - 1) // page for n in seq_lens)
    num_blocks = blocks_needed + 3
    width = width or max((n + page - 1) // page for n in seq_lens) + 2  # padded past the longest
    scratch = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=g)
    tables = torch.full((len(seq_lens), width), scratch, dtype=torch.int32)
    at = 0
    for b, n in enumerate(seq_lens):
        m = (n + page - 1) // page
        tables[b, :m] = perm[at:at + m].int()
        at += m
    k_cache = (torch.randn(num_blocks, page, kv_heads, dim, generator=g) * 3).to(cache_dtype)
    v_cache = (torch.randn(num_blocks, page, kv_heads, dim, generator=g) * 3).to(cache_dtype)
    k_cache[scratch] = float("nan") if cache_dtype != FP8 else torch.tensor(float("nan")).to(FP8)  # masked, never read
    v_cache[scratch] = k_cache[scratch]
    q = torch.randn(len(seq_lens), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("shape", [dict(heads=6, kv_heads=2, dim=64), dict(heads=9, kv_heads=3, dim=64),
                                   dict(heads=4, kv_heads=4, dim=48)], ids=["gqa3", "gqa3-smollm2", "mha-dim48"])
@pytest.mark.parametrize("block_n", [32, 8])  # tiles across pages (16 tokens), and tiles within one
def test_decode_matches_float32_reference(splits, shape, block_n):
    seq_lens = [1, 17, 100, 64, 5, 130]  # mixed, one ending on a page edge, one within a single tile
    q, kc, vc, tables, lens = _decode_case(seq_lens, **shape)
    ks, vs = torch.tensor(0.8), torch.tensor(1.7)
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, splits, ks, vs,
                                     triton_decode.DecodeConfig(block_n=block_n))
    ref = reference_decode(q, kc, vc, tables, lens, 0.125, ks, vs)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [FP8, torch.float32])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_ignores_stale_nans_past_each_context_in_its_last_page(cache_dtype, splits):
    """Whole tiles in a page are read without masks: positions past a context's end (a page's stale rows,
    which a recycled page may hold) must not reach the output, even as NaN (0 * NaN is NaN)."""
    seq_lens = [1, 13, 40, 70]
    q, kc, vc, tables, lens = _decode_case(seq_lens, cache_dtype=cache_dtype)
    nan = torch.tensor(float("nan")).to(cache_dtype)
    for b, n in enumerate(seq_lens):
        last = int(tables[b, (n - 1) // 16])
        kc[last, n % 16 or 16:] = nan
        vc[last, n % 16 or 16:] = nan
    ks, vs = (torch.tensor(0.8), torch.tensor(1.7)) if cache_dtype == FP8 else (None, None)
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, splits, ks, vs,
                                     triton_decode.DecodeConfig(block_n=8))  # tiles within pages of 16
    ref = reference_decode(q, kc, vc, tables, lens, 0.125, ks, vs)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_reads_a_plain_cache_too():
    q, kc, vc, tables, lens = _decode_case([33, 7, 64], cache_dtype=torch.float32)
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, 2, cfg=triton_decode.DecodeConfig(block_n=16))
    ref = reference_decode(q, kc, vc, tables, lens, 0.125, None, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_reads_a_float8_cache_without_scales_as_scaled_by_one():
    q, kc, vc, tables, lens = _decode_case([33, 7, 64])
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, 2, cfg=triton_decode.DecodeConfig(block_n=16))
    one = torch.tensor(1.0)
    torch.testing.assert_close(out, reference_decode(q, kc, vc, tables, lens, 0.125, one, one), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dim", [64, 48])  # a Hadamard matrix (turned in the kernel), a random orthogonal one (GEMMs)
def test_decode_over_a_rotated_cache_turns_q_and_the_output(splits, dim):
    """The kernel given the cache's rotation R equals attention of q R over the cache, turned back by R^T;
    over Sylvester's matrix its butterflies equal the two GEMMs it otherwise runs around the kernel."""
    seq_lens = [1, 17, 100, 40]
    q, kc, vc, tables, lens = _decode_case(seq_lens, heads=6, kv_heads=2, dim=dim)
    r, ks, vs = fp8.hadamard(dim), torch.tensor(0.8), torch.tensor(1.7)
    hadamard = rotated_cache.is_hadamard(r)
    assert hadamard == (dim == 64)
    cfg = triton_decode.DecodeConfig(block_n=16)
    out = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, splits, ks, vs, cfg, rotation=r, hadamard=hadamard)
    ref = reference_decode(q @ r, kc, vc, tables, lens, 0.125, ks, vs) @ r.T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if hadamard:
        gemms = triton_decode.paged_decode(q, kc, vc, tables, lens, 0.125, splits, ks, vs, cfg, rotation=r)
        torch.testing.assert_close(out, gemms, rtol=1e-5, atol=1e-5)


def test_is_hadamard_recognizes_a_multiple_of_sylvesters_matrix_only():
    h = fp8.hadamard(128)
    assert rotated_cache.is_hadamard(h) and rotated_cache.is_hadamard(h.bfloat16()) and rotated_cache.is_hadamard(2 * h)
    assert not rotated_cache.is_hadamard(None) and not rotated_cache.is_hadamard(fp8.hadamard(48))
    assert not rotated_cache.is_hadamard(h[torch.randperm(128, generator=torch.Generator().manual_seed(0))])
    assert not rotated_cache.is_hadamard(torch.eye(128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("dim", [64, 48])
def test_prefill_pages_gathered_by_the_kernel_equal_index_select_then_dequantize(dtype, rotated, dim):
    """The one-launch gather of a float8 cache's pages (scaled, turned back) equals the plain way."""
    from nanoplug.api import AttentionMetadata

    _, kc, vc, tables, lens = _decode_case([40, 3, 17], heads=4, kv_heads=2, dim=dim)
    kc[-1] = vc[-1] = torch.tensor(1.5).to(FP8)  # the scratch page: gathered like any other (its NaN too)
    r = fp8.hadamard(dim).to(dtype) if rotated else None
    # bfloat16: scales of powers of two keep every scaled value exact, so the float32 way rounded once is the answer
    # (PyTorch's CPU bfloat16 matmul rounds on its own way)
    scales = (0.8, 1.7) if dtype == torch.float32 else (0.5, 2.0)
    plain = KVLayer(0, torch.tensor(scales[0]), torch.tensor(scales[1]))
    layer = RotatedKVLayer(plain.index, plain.k_scale, plain.v_scale, r) if rotated else plain
    meta = AttentionMetadata(is_prefill=True, cu_seqlens_q=torch.arange(4, dtype=torch.int32),
                             cu_seqlens_k=torch.tensor([0, 40, 43, 60], dtype=torch.int32), seq_lens=lens,
                             slot_mapping=lens.long(), block_tables=tables, max_seqlen_q=1, max_seqlen_k=40)
    pages = dequantized_pages.DequantizedPages()
    pages.prepare(meta, 16)
    k, v, renumbered = pages.gather(kc, vc, layer, dtype)
    ref_k, ref_v = (x.to(dtype) for x in pages.gather_plain(kc, vc, layer, torch.float32))
    assert k.dtype == v.dtype == dtype and k.shape == (3 * 3, 16, 2, dim)
    # float32 to the digit; bfloat16 to its last bit (the interpreter's cast to bfloat16 truncates)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0.0)
    torch.testing.assert_close(k, ref_k, equal_nan=True, **tol)
    torch.testing.assert_close(v, ref_v, equal_nan=True, **tol)
    assert renumbered.block_tables.flatten().tolist() == list(range(9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_turns_k_and_v_into_the_rotated_basis_then_quantizes(dtype):
    """K R and V R in float32 (one rounding: the quantization), as torch would compute and round them; a
    value within float32 rounding of a tie may round the other way, so at most one e4m3 step apart."""
    torch.manual_seed(0)
    n, heads, dim = 7, 3, 64
    qkv = (torch.randn(n, (4 + 2 * heads) * dim) * 40).to(dtype)
    _, k, v = qkv.split([4 * dim, heads * dim, heads * dim], dim=-1)
    k, v = k.view(n, heads, dim), v.view(n, heads, dim)
    slots = torch.tensor([0, 5, -1, 12, 13, 2, 3])
    r = fp8.hadamard(dim).to(dtype)
    layer = RotatedKVLayer(0, torch.tensor(0.5), torch.tensor(2.0), r)
    kc = torch.zeros(4, 4, heads, dim, dtype=FP8)
    vc = kc.clone()
    fp8.Fp8Store().store(k, v, kc, vc, slots, layer)
    keep = slots >= 0
    for cache, x, scale in ((kc, k, layer.k_scale), (vc, v, layer.v_scale)):
        want = fp8.quantize_reference(x[keep].float() @ r.float(), scale).float()
        got = cache.view(-1, heads, dim)[slots[keep]].float()
        step = want.abs().clamp(min=2 ** -6) / 8  # e4m3: 3 mantissa bits
        assert ((got - want).abs() <= step * 1.01).all()
        assert (got == want).float().mean() > 0.99
    assert cache.view(-1, heads, dim)[1].float().abs().sum() == 0  # a slot no token names is untouched


def test_a_rotating_store_and_backend_leave_no_turning_to_paged_attention(monkeypatch):
    """fp8 store + `triton` (both turn in their kernels): the store's `attend` does no rotation GEMM; with
    `manual` (reads the cache as stored) it turns q, the new K/V and the output itself. Same greedy tokens."""
    calls = []
    rotate = rotated_cache._rotate
    monkeypatch.setattr(rotated_cache, "_rotate", lambda x, r: calls.append(x.shape) or rotate(x, r))
    _, fused = _generate("triton", "fp8")
    assert calls == []
    _, plain = _generate("manual", "fp8")
    assert calls
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]


def test_num_splits_depends_on_host_sizes_only():
    cfg = triton_decode.DecodeConfig()
    assert triton_decode.num_splits(256, 8, 2048, 132, cfg) == 1  # 2048 programs already fill the GPU
    assert triton_decode.num_splits(1, 8, 4096, 132, cfg) == cfg.max_splits
    assert triton_decode.num_splits(1, 8, 10, 132, cfg) == 1  # one tile: nothing to split


# ------------------------------------------------------------------------------ the engine
ENGINE = dict(kv_block_size=16, max_model_len=256, device="cpu", max_num_batched_tokens=24, cpu={"kv_cache_gb": 0.001})


def _generate(attention, kv_cache, dtype="float32"):
    from _checkpoints import PROMPTS, checkpoint
    from nanoplug import LLM, SamplingParams

    llm = LLM(checkpoint("qwen3"), attention=attention, kv_cache=kv_cache, dtype=dtype, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_logits=True)
    prompts = PROMPTS + [PROMPTS[2] + " And then"]  # chunked prefills (24 tokens a step) and a prefix-cache hit
    return llm, llm.generate(prompts, params, use_tqdm=False)


def test_engine_fp8_cache_triton_decode_equals_the_oracle_reading_the_same_cache():
    """The Triton decode kernel and the quantizing store inside the engine against `manual` over the
    same float8 cache (its scales applied): equal within float32 rounding, the same greedy tokens."""
    from _checkpoints import relative_error

    llm, got = _generate("triton", "fp8")
    assert llm.engine.worker.kv_cache.dtype == FP8
    assert llm.engine.worker.ctx.decode.reads_rotated_cache
    assert all(rotated_cache.hadamard_of(layer) for _, _, layer in llm.engine.worker.ctx.kv)  # turned in the kernel
    _, want = _generate("manual", "fp8")
    assert got[-1].num_cached_tokens > 0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits):
            assert relative_error(lb, la) < 1e-5


def test_engine_fp8_cache_stays_close_to_the_plain_cache():
    """Bound: logits within 8% relative error of a float32 cache's (e4m3 keeps 3 mantissa bits, so each
    K/V value is off by at most 1/16 of itself; measured 1-4% on this random checkpoint). Greedy tokens
    are compared only up to where the two first differ: this random model has near ties that a 2%
    change flips, and past that the inputs differ."""
    from _checkpoints import relative_error

    _, want = _generate("manual", "torch")
    _, got = _generate("triton", "fp8")
    compared = 0
    for a, b in zip(want, got):
        for i, (la, lb) in enumerate(zip(a.logits, b.logits)):
            if a.token_ids[:i] != b.token_ids[:i]:
                break
            assert relative_error(lb, la) < 0.08
            compared += 1
    assert compared >= 15


def test_fp8_cache_holds_twice_the_blocks_of_a_16_bit_cache():
    from _checkpoints import checkpoint
    from nanoplug import LLM

    def blocks(kv_cache):
        llm = LLM(checkpoint("qwen3"), attention="sdpa", kv_cache=kv_cache, dtype="bfloat16", **ENGINE)
        return llm.engine.num_kv_blocks

    assert blocks("fp8") == 2 * blocks("torch")  # sized by kv_cache_gb over bytes per block: 1 byte a value


def test_backends_say_whether_they_read_a_float8_cache():
    from nanoplug.api import ModelFacts, Target
    from nanoplug.plugins.attention.cpu import CpuAttention
    from nanoplug.plugins.attention.flash import FlashAttention
    from nanoplug.plugins.attention.triton import TritonAttention

    facts = ModelFacts("Qwen3ForCausalLM", 2, 4, 2, 16, 64, 100)
    target = Target(device=torch.device("cpu"), dtype=torch.float32, model=facts, kv_cache_dtype=FP8)
    assert TritonAttention.unavailable(target) == []  # interpreter on
    assert any("float8_e4m3fn" in r for r in CpuAttention.unavailable(target))
    assert FlashAttention.unavailable(target) and "needs CUDA" in FlashAttention.unavailable(target)[0]
    assert fp8.Fp8Store.unavailable(target) == []
    assert fp8.Fp8Store.priority < 10  # "auto" never trades accuracy for memory by itself


def test_sdpa_reads_a_float8_cache_in_decode_and_prefill():
    """`sdpa` on CPU (its gathered decode path and its padded prefill) over the fp8 cache, against `manual`."""
    from _checkpoints import relative_error

    _, want = _generate("manual", "fp8")
    _, got = _generate("sdpa", "fp8")
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits):
            assert relative_error(lb, la) < 1e-5


@pytest.mark.parametrize("n", [64, 128, 48])
def test_the_rotation_is_orthogonal(n):
    r = fp8.hadamard(n).double()
    assert torch.allclose(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
    if n & (n - 1) == 0:
        assert torch.equal(r, r.T) and set((r.abs() * n ** 0.5).round().flatten().tolist()) == {1.0}


def test_a_rotated_cache_leaves_attention_unchanged():
    """A store that keeps its cache rotated turns q, k and v into its basis and the output back around a
    backend that reads the cache as stored (`attend_rotated`, the store's `attend`): a float32 cache kept
    rotated gives the plain cache's logits within float32 rounding, through decode and chunked prefill,
    and the fp8 store really hands its rotation to every layer."""
    import types

    from _checkpoints import relative_error
    from nanoplug import LLM, SamplingParams, hookimpl
    from nanoplug.api import PLUGIN_API_VERSION
    from nanoplug.engine.registry import Registry
    from nanoplug.plugins.kv_cache.torch import TorchStore

    class RotatedStore(TorchStore):  # a third-party store: it rotates nothing itself, `attend_rotated` does
        def layer(self, index, spec, device, dtype):
            return rotated_cache.RotatedKVLayer(index, rotation=fp8.hadamard(spec.head_dim).to(device, dtype))

        def attend(self, backend, q, k, v, k_cache, v_cache, slot_mapping, layer):
            return rotated_cache.attend_rotated(self, backend, q, k, v, k_cache, v_cache, slot_mapping, layer,
                                                store_turns=False)

    module = types.ModuleType("rotated_store")
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION
    module.nanoplug_register_kv_cache = hookimpl(lambda register: register.add("rotated", RotatedStore))
    registry = Registry()
    registry.add_plugin_module(module, "test")
    from _checkpoints import PROMPTS, checkpoint

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_logits=True)
    prompts = PROMPTS + [PROMPTS[2] + " And then"]
    rotated = LLM(checkpoint("qwen3"), registry=registry, attention="manual", kv_cache="rotated", **ENGINE)
    assert all(rotated_cache.rotation_of(layer) is not None for _, _, layer in rotated.engine.worker.ctx.kv)
    got = rotated.generate(prompts, params, use_tqdm=False)
    _, want = _generate("manual", "torch")
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits):
            assert relative_error(lb, la) < 1e-5
    llm, _ = _generate("manual", "fp8")
    r = fp8.hadamard(llm.engine.worker.kv_spec.head_dim)
    assert all(torch.equal(layer.rotation, r) for _, _, layer in llm.engine.worker.ctx.kv)
