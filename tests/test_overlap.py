"""Overlapped steps (`overlap_steps=True`): the engine launches step N+1 before it reads step N's
tokens, so the next step's input tokens come from the device and a sequence that ends (EOS, stop
string, stop id) has run one step ahead for nothing. None of that may show in the outputs: they must
equal the one-step-at-a-time engine's in every token, text, finish reason, logit and block count."""
from __future__ import annotations

import pytest
import torch

from _checkpoints import PROMPTS, checkpoint
from _engine_checks import assert_idle, interrupt_generate
from nanoplug import LLM, SamplingParams
from nanoplug.engine.sequence import PENDING

OPTIONS = dict(kv_block_size=16, attention="sdpa", kv_cache="torch", num_kv_blocks=64, max_model_len=256)


def engine(overlap: bool, **options) -> LLM:
    return LLM(checkpoint(), **{**OPTIONS, **options, "overlap_steps": overlap})


@pytest.fixture(scope="module")
def pair():
    return engine(False), engine(True)


def outputs_equal(a, b, same_cache_hits: bool = True) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        if same_cache_hits:
            assert x.num_cached_tokens == y.num_cached_tokens
        assert PENDING not in x.token_ids and PENDING not in y.token_ids
        assert len(x.logits) == len(y.logits)
        for lx, ly in zip(x.logits, y.logits):
            torch.testing.assert_close(lx, ly, rtol=0, atol=1e-5)


def mixed_params(sync: LLM) -> list[SamplingParams]:
    """Requests that end in every way, at different steps: length, stop string, stop id, EOS."""
    free = sync.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return [
        SamplingParams(temperature=0, max_tokens=5, output_logits=True),
        SamplingParams(temperature=0, max_tokens=24, stop=[free[1].text[6:12]]),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[2].token_ids[7]]),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
    ]


def test_the_engine_really_overlaps(pair):
    _, fast = pair
    core = fast.engine
    assert core.overlap
    for prompt in PROMPTS:
        core.add_request(core.make_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    assert core.step() == []  # the first step is launched; nothing has come back yet
    seen_pending = False
    while core.scheduler.has_work():
        core.step()
        # the step just launched is still on its way while the one before it was resolved
        assert len(core.worker.pending) == (1 if core.in_flight else 0)
        seen_pending |= any(PENDING in s.token_ids for s in core.scheduler.running)
    while core.has_unfinished():  # a step still on the device is collected
        core.step()
    assert seen_pending
    assert_idle(fast)


def test_cpu_default_is_one_step_at_a_time():
    assert not LLM(checkpoint(), **OPTIONS).engine.overlap


@pytest.mark.parametrize("repeat", [1, 2])  # the second run starts from prefix-cache hits
def test_every_way_of_ending_gives_the_same_outputs(pair, repeat):
    sync, fast = pair
    params = mixed_params(sync)
    prompts = PROMPTS * 3
    outputs_equal(sync.generate(prompts, params * 3, use_tqdm=False), fast.generate(prompts, params * 3, use_tqdm=False))
    assert_idle(fast)


def test_preemption_and_small_chunks_give_the_same_outputs():
    options = dict(num_kv_blocks=9, max_model_len=144, max_num_batched_tokens=20)
    sync, fast = engine(False, **options), engine(True, **options)
    params = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=20, stop_token_ids=[i * 97])
              for i in range(8)]
    prompts = [p + f" {i}" for i, p in enumerate(PROMPTS * 2)]
    # preempted requests find different cached prefixes when they return (blocks are registered a
    # step later), so only the cache hits may differ
    outputs_equal(sync.generate(prompts, params, use_tqdm=False), fast.generate(prompts, params, use_tqdm=False),
                  same_cache_hits=False)
    assert fast.engine.scheduler.num_preemptions > 0
    assert_idle(fast)


def test_max_model_len_ends_requests_at_the_same_token():
    sync, fast = engine(False, max_model_len=40), engine(True, max_model_len=40)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    a, b = sync.generate(PROMPTS, params, use_tqdm=False), fast.generate(PROMPTS, params, use_tqdm=False)
    outputs_equal(a, b)
    assert all(o.finish_reason == "length" and len(o.prompt_token_ids) + len(o.token_ids) == 40 for o in b)


def test_streams_match_and_an_early_exit_frees_everything(pair):
    sync, fast = pair
    params = mixed_params(sync)[1]
    want = sync.generate(PROMPTS[1], params, use_tqdm=False)[0]
    deltas = list(fast.stream(PROMPTS[1], params))
    assert "".join(d.text for d in deltas) == want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert all(PENDING not in d.token_ids for d in deltas) and deltas[-1].finished
    stream = fast.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert_idle(fast)


def test_an_interrupted_generate_leaves_nothing_behind(pair):
    sync, fast = pair
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    interrupt_generate(fast, 4, PROMPTS, params)
    assert_idle(fast)
    outputs_equal(sync.generate(PROMPTS, params, use_tqdm=False), fast.generate(PROMPTS, params, use_tqdm=False))
