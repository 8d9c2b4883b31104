"""The engine against Hugging Face transformers on tiny random Qwen3 and Qwen2 checkpoints (float32).

Logits of prefill and of every decode step must be within 1e-4 (relative) of transformers' forward
on the full sequence, and greedy tokens must equal transformers' `generate`, token for token, on
every path the scheduler can take: several prompt lengths in one batch, prefix-cache hits (shared
prefixes, repeated prompts, prompts exactly one block long), small prefill chunks, preemption,
both attention backends `manual` and `sdpa`, and both KV-cache stores.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from functools import lru_cache

import pytest
import torch

import _processes
from _checkpoints import checkpoint, hf_greedy, hf_logits, prompt_ids, relative_error, tokenizer
from nanoplug import LLM, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12)
STORY = (
    "In the quiet village of Alder Creek, the baker rose before dawn each morning to light the ovens, knead "
    "the dough and shape the loaves that the whole valley would eat by noon. Nobody remembered a day when "
    "the bread had been late, not even during the great flood of the old spring."
)


def engine(name: str = "qwen3", **options) -> LLM:
    settings = dict(kv_block_size=BLOCK, attention="manual", kv_cache="torch", num_kv_blocks=64, max_model_len=256)
    settings.update(options)
    return LLM(checkpoint(name), **settings)


def cache_prompts(name: str = "qwen3") -> list[list[int]]:
    """Prompts that share prefixes, repeat, and end exactly on block boundaries."""
    story = tokenizer(name).encode(STORY)
    return [
        story[:BLOCK],  # exactly one block
        story[:2 * BLOCK],  # exactly two blocks: the second repeats the first's block
        story[:40],
        story[:40] + story[50:55],  # shares 2.5 blocks with the one before
        story[:BLOCK],  # a repeat in the same batch
        story,
    ] + prompt_ids(name)


@lru_cache(maxsize=None)
def reference(name: str, max_tokens: int, prompts_key: str) -> list[list[int]]:
    prompts = cache_prompts(name) if prompts_key == "cache" else prompt_ids(name)
    return [hf_greedy(name, ids, max_tokens) for ids in prompts]


def tokens_of(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


# ------------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "qwen2", "qwen2_tied"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_logits_and_greedy_tokens_match_transformers(name, attention):
    llm = engine(name, attention=attention)
    params = SamplingParams(temperature=0, max_tokens=6, output_logits=True, ignore_eos=True)
    prompts = prompt_ids(name)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for ids, out in zip(prompts, outputs):
        assert len(out.logits) == len(out.token_ids) == 6
        want = hf_logits(name, ids + out.token_ids[:-1])[len(ids) - 1:]  # prefill row, then each decode row
        got = torch.stack(out.logits)
        assert got.shape == want.shape
        for step, (g, w) in enumerate(zip(got, want)):
            assert relative_error(g, w) < 1e-4, f"{name}/{attention} prompt of {len(ids)} tokens, step {step}"
        assert out.token_ids == got.argmax(-1).tolist()  # greedy takes the top logit
    assert tokens_of(outputs) == [hf_greedy(name, ids, 6) for ids in prompts]


def test_sdpa_logits_match_manual():
    """The fast path against the plain one on the same inputs, prefill and decode, chunked and cached."""
    params = SamplingParams(temperature=0, max_tokens=5, output_logits=True, ignore_eos=True)
    prompts = cache_prompts()
    runs = {}
    for attention in ("manual", "sdpa"):
        llm = engine(attention=attention, max_num_batched_tokens=24)
        llm.generate(prompts[:3], params, use_tqdm=False)  # warm the prefix cache
        runs[attention] = llm.generate(prompts, params, use_tqdm=False)
    for manual, sdpa in zip(runs["manual"], runs["sdpa"]):
        assert manual.token_ids == sdpa.token_ids
        assert relative_error(torch.stack(sdpa.logits), torch.stack(manual.logits)) < 1e-5


# ------------------------------------------------------------------------- greedy on every path
VARIANTS = {
    "manual": dict(attention="manual"),
    "sdpa": dict(attention="sdpa"),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunks_of_7": dict(max_num_batched_tokens=7),
    "chunks_of_13_sdpa": dict(attention="sdpa", max_num_batched_tokens=13),
    "preemption": dict(num_kv_blocks=9, max_model_len=144),
    "preemption_chunks_sdpa": dict(attention="sdpa", num_kv_blocks=9, max_model_len=144, max_num_batched_tokens=20),
    "two_seqs_at_a_time": dict(max_num_seqs=2),
    "overlapped_steps": dict(overlap_steps=True),
    "overlapped_preemption_chunks_sdpa": dict(attention="sdpa", num_kv_blocks=9, max_model_len=144,
                                              max_num_batched_tokens=20, overlap_steps=True),
}


QWEN2_VARIANTS = ["manual", "chunks_of_7", "preemption_chunks_sdpa"]  # Qwen2 differs only in the model


@pytest.mark.parametrize("name,variant", [("qwen3", v) for v in VARIANTS] + [("qwen2", v) for v in QWEN2_VARIANTS])
def test_greedy_equals_transformers(name, variant):
    options = VARIANTS[variant]
    llm = engine(name, **options)
    prompts = cache_prompts(name)
    want = reference(name, GREEDY.max_tokens, "cache")
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.index for o in first] == list(range(len(prompts)))
    assert tokens_of(first) == want
    second = llm.generate(prompts, GREEDY, use_tqdm=False)  # now every full prompt block is cached
    assert tokens_of(second) == want
    if llm.config.enable_prefix_caching and "num_kv_blocks" not in options:  # room enough: no eviction
        assert all(o.num_cached_tokens == BLOCK * ((len(p) - 1) // BLOCK) for o, p in zip(second, prompts))
    if llm.config.enable_prefix_caching:
        assert sum(o.num_cached_tokens for o in second) > 0
    else:
        assert all(o.num_cached_tokens == 0 for o in second)
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    assert not llm.engine.scheduler.has_work()
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.num_kv_blocks  # every block came back


def test_preemption_with_sampling_keeps_seeded_outputs():
    """Recompute after preemption must not change a seeded sample: same seed, same tokens."""
    params = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=16, ignore_eos=True) for i in range(8)]
    prompts = cache_prompts()[:8]
    roomy = engine(attention="sdpa").generate(prompts, params, use_tqdm=False)
    tight_llm = engine(attention="sdpa", num_kv_blocks=9, max_model_len=144)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.engine.scheduler.num_preemptions > 0
    assert tokens_of(tight) == tokens_of(roomy)
    assert all(len(o.token_ids) == 16 for o in tight)


def test_sdpa_padded_decode_equals_transformers():
    """sdpa's decode steps take the padded path on CUDA where varlen_attn cannot serve them (float32, a cache
    of another dtype; the gather-only one is for CPUs): that path, checked here on the CPU with the
    gather-only decode turned off."""
    llm = engine(attention="sdpa", max_num_batched_tokens=20)
    backend = llm.engine.worker.ctx.decode
    assert backend.paged_decode is not None  # CPU: gather-only decode by default
    backend.paged_decode = None
    assert tokens_of(llm.generate(cache_prompts(), GREEDY, use_tqdm=False)) == reference("qwen3", GREEDY.max_tokens, "cache")
    assert not backend.decoding  # the padded path served every decode step


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_garbage_in_a_fresh_kv_cache_never_reaches_the_output(attention):
    """A CPU cache starts as uninitialized memory: NaN there must not leak through padded reads."""
    llm = engine(attention=attention, max_num_batched_tokens=20)
    # every block the engine hands out; the scratch block past them (padding's) is zeroed when allocated
    llm.engine.worker.kv_cache[:, :, :-1].fill_(float("nan"))
    prompts = cache_prompts()
    assert tokens_of(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference("qwen3", GREEDY.max_tokens, "cache")


# ---------------------------------------------------------------------------- triton KV store
TRITON_SCRIPT = """
import json, sys
from nanoplug import LLM, SamplingParams
path, prompts, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(path, kv_cache="triton", device="cpu", **options)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]))
runs = [[o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
print("RESULT" + json.dumps({"runs": runs, "preemptions": llm.engine.scheduler.num_preemptions}))
"""


@pytest.mark.skipif(importlib.util.find_spec("nanoplug.plugins.kv_cache.triton") is None,
                    reason="nanoplug.plugins.kv_cache.triton is not written yet")
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_triton_kv_store_greedy_equals_transformers(attention):
    """The Triton store kernel under TRITON_INTERPRET=1 (set before triton is imported: a fresh process)."""
    prompts = cache_prompts()
    options = dict(kv_block_size=BLOCK, attention=attention, num_kv_blocks=9, max_model_len=144,
                   max_num_batched_tokens=20)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = _processes.run(
        [sys.executable, "-c", TRITON_SCRIPT, checkpoint(), json.dumps(prompts), json.dumps(options),
         str(GREEDY.max_tokens)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    want = reference("qwen3", GREEDY.max_tokens, "cache")
    assert result["runs"] == [want, want]
    assert result["preemptions"] > 0
