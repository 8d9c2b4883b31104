"""The C++ CPU kernels (nanoplug/kernels/cpu) against the torch code they replace, on the same inputs:
each op alone (odd sizes, strided views, the threaded sizes), the `cpu` attention backend and the fused
ops inside an engine (same tokens and logits as the plain engine), and the build: cached, and a clear
reason, with the plain path chosen, where no compiler works. The packed GEMM's engine-level checks are
in test_packed_linear.py."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from _checkpoints import CHECKPOINTS, PROMPTS, checkpoint
from nanoplug import LLM, SamplingParams
from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.plugins.platforms.cpu import packed_linear
from nanoplug.api import ModelFacts, Target
from nanoplug.kernels.cpu import build
from nanoplug.plugins.attention.cpu import CpuAttention
from nanoplug.api import RotaryEmbedding, add_rms_norm, apply_rope, rms_norm, silu_and_mul

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def kernels():
    """The kernels must build on a machine with a compiler (CI has one): a failure here is a failure."""
    assert build.find_compiler() is not None, "these tests need a C++ compiler (g++ or clang++)"
    return cpu_kernels.kernels()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ the ops
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 100), (37, 64), (300, 576)])  # tails, threaded rows
def test_rms_norm_and_add_rms_norm(kernels, rows, dim):
    x, residual = torch.randn(rows, dim, generator=gen()), torch.randn(rows, dim, generator=gen(1))
    weight = torch.rand(dim, generator=gen(2)) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **TOL)
    out, summed = kernels.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_summed = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(summed, ref_summed)


def test_rms_norm_of_head_views(kernels):
    """Qwen3's q/k norms normalize [N, H, D] views of the qkv output: heads dense, rows strided."""
    qkv = torch.randn(7, 4 * 16 + 2 * 16 * 2, generator=gen())
    q = qkv[:, : 4 * 16].view(7, 4, 16)
    k = qkv[:, 4 * 16: 6 * 16].view(7, 2, 16)
    weight = torch.rand(16, generator=gen(1)) + 0.5
    for view in (q, k, q.transpose(0, 1)):  # the last one is not head-dense: copied first
        torch.testing.assert_close(kernels.rms_norm(view, weight, 1e-6), rms_norm(view, weight, 1e-6), **TOL)


@pytest.mark.parametrize("rows,d", [(1, 40), (3, 1536), (40, 1536)])
def test_silu_and_mul(kernels, rows, d):
    x = torch.randn(rows, 2 * d, generator=gen()) * 8
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-30])  # e^x clamped at both ends, zero, tiny
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul(x), **TOL)


@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])  # scalar tail, vector + tail, vectors only
def test_rope_in_place_on_the_qkv_views(kernels, head_dim):
    cfg = type("Cfg", (), {"rope_theta": 10000.0})()
    rotary = RotaryEmbedding(cfg, head_dim, 512)
    n, hq, hk = 9, 6, 2
    qkv = torch.randn(n, (hq + 2 * hk) * head_dim, generator=gen())
    positions = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 42])
    q = qkv[:, : hq * head_dim].view(n, hq, head_dim)
    k = qkv[:, hq * head_dim: (hq + hk) * head_dim].view(n, hk, head_dim)
    ref_q, ref_k = apply_rope(positions, q.clone(), k.clone(), rotary.cos, rotary.sin)
    out_q, out_k = kernels.rope(positions, q, k, rotary.cos, rotary.sin)
    torch.testing.assert_close(out_q, ref_q, **TOL)
    torch.testing.assert_close(out_k, ref_k, **TOL)
    assert out_q.data_ptr() == q.data_ptr()  # in place on the views, as the model uses them
    q2, k2 = kernels.rope(positions.int(), q.clone(), k.clone(), rotary.cos, rotary.sin)  # int32 positions too
    torch.testing.assert_close(q2, apply_rope(positions, out_q.clone(), k.clone(), rotary.cos, rotary.sin)[0], **TOL)
    with pytest.raises(ValueError, match="head size"):
        kernels.rope(positions, q, k, rotary.cos[:, :8], rotary.sin[:, :8])


@pytest.mark.parametrize("n,k", [(960, 576), (7, 5), (48, 48), (1000, 33), (3 * 48 + 1, 130)])
def test_linear_through_the_packed_weight(kernels, n, k):
    """Whole and partial column panels (48 wide with AVX-512, 16 else), k-blocks of 64 and a remainder, 1-64
    rows (8- or 6-row tiles and every remainder), with and without bias."""
    weight, bias = torch.randn(n, k, generator=gen()), torch.randn(n, generator=gen(1))
    packed = kernels.pack_weight(weight)
    for rows in (1, 2, 3, 5, 7, 8, 9, 15, 16, 31, 33, 64):
        x = torch.randn(rows, k, generator=gen(rows))
        torch.testing.assert_close(kernels.linear(x, packed, weight, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kernels.linear(x, packed, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="at most 64 rows"):
        kernels.linear(torch.randn(65, k), packed, weight, None)


def test_argmax_takes_the_first_maximum(kernels):
    x = torch.randn(6, 1000, generator=gen())
    x[1, 3] = x[1, 900] = 50.0  # a tie: the first wins
    x[2, 999] = 60.0  # in the scalar tail
    x[3] = 0.0  # all equal
    x[4, 16] = x[4, 17] = 70.0  # a tie inside one vector
    x[5] = float("-inf")
    x[5, 500] = -1.0
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    wide = torch.randn(40, 49152, generator=gen(1))  # the threaded size (a 49k vocabulary)
    assert torch.equal(kernels.argmax(wide), wide.argmax(dim=-1))
    assert torch.equal(kernels.argmax(wide[:, 5:]), wide[:, 5:].argmax(dim=-1))  # strided rows


def reference_decode(q, k_cache, v_cache, tables, seq_lens, scale):
    """One query per sequence, in plain torch: gather each sequence's keys and values, attend."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        pos = torch.arange(length)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [L, H, D], float32
        values = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b], keys) * scale, dim=-1)
        out.append(torch.einsum("hl,lhd->hd", weights, values))
    return torch.stack(out)


@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [
    (64, 9, 3, 16),  # SmolLM2's shape
    (64, 4, 4, 1),  # no grouping, one token per block
    (128, 8, 4, 7),  # an odd block size
    (128, 16, 2, 16),  # 8 heads per KV head: the generic group path
    (256, 16, 1, 32),  # 16 heads per KV head: the most served
])
def test_paged_decode_matches_gathered_attention(kernels, head_dim, heads, kv_heads, block_size):
    batch = 6
    seq_lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 37, 5], dtype=torch.int32)
    max_blocks = math.ceil(int(seq_lens.max()) / block_size) + 1
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen())
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen(1))
    tables = torch.randperm(num_blocks, generator=gen(2))[: batch * max_blocks].view(batch, max_blocks).int()
    tables[:, -1] = -1  # padding past the last block, as the runner fills it
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen(3))
    q = qkv[:, : heads * head_dim].view(batch, heads, head_dim)  # strided rows, as the model passes q
    scale = head_dim ** -0.5
    out = kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(out, reference_decode(q, k_cache, v_cache, tables, seq_lens, scale), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [(64, 9, 3, 16), (128, 16, 2, 7)])
def test_the_decode_kernel_reads_a_float16_cache(kernels, head_dim, heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(0)
    batch = 5
    seq_lens = torch.tensor([1, block_size + 1, 3 * block_size - 1, 37, 5], dtype=torch.int32)
    max_blocks = math.ceil(int(seq_lens.max()) / block_size) + 1
    num_blocks = batch * max_blocks + 2
    k_cache = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * 3).half()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).half()
    k_cache.view(-1)[:5] = torch.tensor([1e-6, -6e-5, 65504.0 / 1e3, 0.0, -0.0]).half()  # subnormals, zeros
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).int()
    q = torch.randn(batch, heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    out = kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(out, reference_decode(q, k_cache, v_cache, tables, seq_lens, scale), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="float32 or float16"):
        kernels.paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, seq_lens, scale)


def test_paged_decode_refuses_what_it_does_not_serve(kernels):
    k_cache = torch.zeros(4, 16, 2, 80)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head sizes"):
        kernels.paged_decode(torch.zeros(1, 4, 80), k_cache, k_cache, table, lens, 0.1)
    k_cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_decode(torch.zeros(1, 4, 64), k_cache, k_cache, table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="dense caches"):
        kernels.paged_decode(torch.zeros(1, 4, 64), k_cache.transpose(1, 2), k_cache, table, lens, 0.1)
    out = kernels.paged_decode(torch.ones(1, 4, 64), k_cache, k_cache, table, torch.zeros(1, dtype=torch.int32), 0.1)
    assert torch.equal(out, torch.zeros(1, 4, 64))  # an empty context gives zeros, not garbage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_store_equals_the_index_copies(kernels, dtype):
    """K and V as views of a fused qkv row (strided rows), into caches of their dtype; a negative slot is skipped."""
    caches = [torch.zeros(6, 16, 3, 64, dtype=dtype) for _ in range(4)]
    qkv = torch.randn(5, 9 * 64, generator=gen(3)).to(dtype)
    k, v = qkv[:, 192:384].view(5, 3, 64), qkv[:, 384:].view(5, 3, 64)
    slots = torch.tensor([3, 17, 95, 40, 0])
    kernels.kv_store(k, v, caches[0], caches[1], slots)
    caches[2].view(-1, 3, 64).index_copy_(0, slots, k)
    caches[3].view(-1, 3, 64).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    kernels.kv_store(k + 1, v + 1, caches[0], caches[1], torch.tensor([-1, 17, -1, -1, -1]))
    assert torch.equal(caches[0].view(-1, 3, 64)[17], k[1] + 1) and torch.equal(caches[0].view(-1, 3, 64)[3], k[0])
    with pytest.raises(ValueError, match="does not convert"):
        kernels.kv_store(k.float(), v.float(), caches[0].half(), caches[1].half(), slots)


# ----------------------------------------------------------------------------------------- engines
ENGINE = dict(kv_block_size=16, kv_cache="torch", num_kv_blocks=96, max_model_len=256)
HEAD64 = ("Qwen3ForCausalLM", dict(head_dim=64, num_attention_heads=6, num_key_value_heads=2, seed=5))
HEAD128 = ("Qwen3ForCausalLM", dict(head_dim=128, num_attention_heads=4, num_key_value_heads=1, seed=6))


CHECKPOINTS.update(head64=HEAD64, head128=HEAD128)  # head sizes the decode kernel serves (the tiny ones: 16)


@pytest.fixture(scope="module", params=["head64", "head128"])
def served_checkpoint(request):
    return checkpoint(request.param)


@pytest.mark.parametrize("batched_tokens", [16384, 24])  # whole prompts, and chunked prefill
def test_engine_with_kernels_gives_the_plain_engines_tokens_and_logits(kernels, served_checkpoint, batched_tokens):
    plain = LLM(served_checkpoint, **ENGINE, attention="sdpa", cpu={"kernels": False}, max_num_batched_tokens=batched_tokens)
    fast = LLM(served_checkpoint, **ENGINE, attention="cpu", cpu={"kernels": True}, max_num_batched_tokens=batched_tokens)
    assert fast.engine.worker.sampler.greedy == kernels.argmax
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_logits=True)
    prompts = PROMPTS * 3 + [PROMPTS[2] + " And then"]  # 13 sequences; the last reuses a cached prefix
    for a, b in zip(plain.generate(prompts, params, use_tqdm=False), fast.generate(prompts, params, use_tqdm=False)):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)


def test_the_fused_ops_are_in_the_model_only_when_asked(kernels, served_checkpoint):
    fast = LLM(served_checkpoint, **ENGINE, attention="sdpa")  # cpu kernels None: on where they build
    norms = [m for m in fast.engine.worker.model.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all(m.fused == kernels.rms_norm for m in norms)
    plain = LLM(served_checkpoint, **ENGINE, attention="sdpa", cpu={"kernels": False})
    assert all(m.fused is None for m in plain.engine.worker.model.modules() if type(m).__name__ == "RMSNorm")


def test_the_cpu_kv_store_gives_the_plain_stores_tokens_and_logits(kernels, served_checkpoint):
    """The same engine with `kv_cache="cpu"` and `"torch"`: bit-equal logits (the store copies), decode steps replayed
    from recordings (the store's calls are recorded like the other kernels'), and "auto" picks it here."""
    options = {**ENGINE, "attention": "cpu"}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_logits=True)
    prompts = PROMPTS * 2 + [PROMPTS[2] + " And then"]
    plain = LLM(served_checkpoint, **options)
    fast = LLM(served_checkpoint, **{**options, "kv_cache": "cpu"})
    for a, b in zip(plain.generate(prompts, params, use_tqdm=False), fast.generate(prompts, params, use_tqdm=False)):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(la, lb) for la, lb in zip(a.logits, b.logits, strict=True))
    assert fast.engine.worker.report().stats.graph_replays > 0
    auto = LLM(served_checkpoint, **{**options, "kv_cache": "auto"})
    assert auto.choices["kv_cache"].name == "cpu"


def test_the_cpu_kv_store_says_why_it_cannot_serve(kernels):
    from nanoplug.plugins.kv_cache.cpu import CpuStore

    assert CpuStore.unavailable(target()) == [] and CpuStore.unavailable(target(torch.bfloat16)) == []
    assert any("runs on the CPU" in r for r in CpuStore.unavailable(target(device="cuda")))
    fp16_cache = Target(device=torch.device("cpu"), dtype=torch.float32, model=facts(), kv_cache_dtype=torch.float16)
    assert any("float16 cache" in r for r in CpuStore.unavailable(fp16_cache))


def facts(head_dim=64, heads=9, kv_heads=3) -> ModelFacts:
    return ModelFacts("LlamaForCausalLM", 2, heads, kv_heads, head_dim, 576, 1000)


def target(dtype=torch.float32, device="cpu", **shape) -> Target:
    return Target(device=torch.device(device), dtype=dtype, model=facts(**shape))


def test_cpu_attention_says_why_it_cannot_serve(kernels):
    assert CpuAttention.unavailable(target()) == []
    assert any("float32 only" in r and "sdpa" in r for r in CpuAttention.unavailable(target(torch.bfloat16)))
    assert any("head size 80" in r for r in CpuAttention.unavailable(target(head_dim=80)))
    assert any("query heads per KV head" in r for r in CpuAttention.unavailable(target(heads=32, kv_heads=1)))
    assert any("runs on the CPU" in r for r in CpuAttention.unavailable(target(device="cuda")))


@pytest.fixture
def no_kernels(monkeypatch, tmp_path):
    """A machine whose compiler does not exist: nothing cached, nothing built."""
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernels._load.cache_clear()
    yield
    cpu_kernels._load.cache_clear()


def test_without_a_compiler_the_engine_runs_the_plain_path_and_says_why(no_kernels, caplog):
    reason = cpu_kernels.unavailable()
    assert "no C++ compiler found" in reason and "g++" in reason and "cpu={'kernels': False}" in reason
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        llm = LLM(checkpoint("head64"), **ENGINE)
    assert llm.choices["attention"].name == "sdpa"
    assert "cpu_kernels: not used: no C++ compiler found" in caplog.text
    assert all(m.fused is None for m in llm.engine.worker.model.modules() if type(m).__name__ == "RMSNorm")
    packed = [m.packed for m in llm.engine.worker.model.modules() if getattr(m, "packed", None) is not None]
    assert packed and all(p.mm is packed_linear._mkl_mm for p in packed)  # MKL's packed GEMM instead
    assert llm.engine.worker.sampler.greedy is not cpu_kernels.kernels
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].token_ids) == 3
    with pytest.raises(Exception, match=r"attention plugin .cpu. cannot serve.*no C\+\+ compiler found"):
        LLM(checkpoint("head64"), **ENGINE, attention="cpu")


def test_a_failing_compiler_is_reported_with_its_command(no_kernels, tmp_path, monkeypatch):
    failing = tmp_path / "bad-c++"
    failing.write_text("#!/bin/sh\necho 'fatal: no room' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    with pytest.raises(build.KernelsUnavailable, match="(?s)could not build.*fatal: no room.*cpu=.'kernels': False."):
        build.library_path()
    assert not list(tmp_path.glob("cpu_kernels/*/*.so*"))  # no half-written library left behind


def test_the_build_is_cached_per_machine(kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    path = build.library_path()
    assert path.is_file() and path.parent.parent == tmp_path / "cpu_kernels"

    def no_compiling(cmd, *args, **kwargs):
        if "--version" not in cmd:
            raise AssertionError("compiled again: " + " ".join(cmd))
        return real_run(cmd, *args, **kwargs)

    real_run = build.subprocess.run
    monkeypatch.setattr(build.subprocess, "run", no_compiling)
    assert build.library_path() == path
