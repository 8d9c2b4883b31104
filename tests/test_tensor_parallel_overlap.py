"""Overlapped steps under `tensor` (the spawned pool, gloo on CPU): the engine launches step N+1 before it
collects step N, the ranks read N+1's input tokens from rank 0's sampled ones on their devices, and
nothing of that shows in the outputs: float32 tokens and logits equal one process's and the
one-step-at-a-time tp=2 engine's, across generate calls, streams and aborts. A launch returns before its
step is computed, and a rank that fails in a launched step is reported at the next collect.
(torchrun's ranks overlap too: tests/test_tensor_parallel.py runs them both ways.)"""
from __future__ import annotations

import time

import pytest

import tensor_parallel_helpers as helpers
from _engine_checks import interrupt_generate
from _processes import gone
from nanoplug import LLM, Registry, SamplingParams
from nanoplug.engine.sequence import PENDING
from nanoplug.plugins.parallel.tensor.pool import WorkerError

DEADLINE_S = 180  # a fault must surface well within this, on a busy 2-core machine
PROMPTS = helpers.PROMPTS + ["The capital of France is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from nanoplug.bench.checkpoints import write_random_checkpoint

    return str(write_random_checkpoint(tmp_path_factory.mktemp("tp_overlap") / "qwen3", tie_word_embeddings=True))


@pytest.fixture(scope="module")
def engines(ckpt):
    """tp=1, tp=2 one step at a time, tp=2 overlapped: float32, chunked prefill, prefix caching."""
    made = {"single": LLM(ckpt, parallel="single", **helpers.ENGINE_OPTIONS)}
    try:
        for name, overlap in (("plain", False), ("fast", True)):
            made[name] = LLM(ckpt, parallel="tensor", tensor_parallel_size=2, overlap_steps=overlap,
                             **helpers.ENGINE_OPTIONS)
        yield made
    finally:
        for llm in made.values():
            llm.close()


def assert_same(want, got) -> None:
    for a, b in zip(want, got, strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)  # (cache hits depend on each one's past)
        assert PENDING not in b.token_ids and len(a.logits) == len(b.logits) == len(a.token_ids)
        for x, y in zip(a.logits, b.logits):
            assert float((x - y).abs().max() / x.abs().max()) <= 1e-5


def assert_idle(llm: LLM) -> None:
    core = llm.engine
    assert not core.scheduler.has_work() and core.in_flight is None
    assert core.scheduler.blocks.num_free_blocks == core.num_kv_blocks


def test_tensor_overlaps_when_asked(engines):
    fast, plain = engines["fast"].engine, engines["plain"].engine
    assert fast.overlap and not plain.overlap  # CPU's default is off; overlap_steps=True turns it on for tensor
    for prompt in PROMPTS[:3]:
        fast.add_request(fast.make_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    assert fast.step() == []  # launched; nothing back yet
    seen_pending = False
    while fast.has_unfinished():
        fast.step()
        seen_pending |= any(PENDING in s.token_ids for s in fast.scheduler.running)
    assert seen_pending  # decode inputs came from the ranks' devices
    assert_idle(engines["fast"])


def test_generate_calls_give_one_process_tokens_and_logits(engines):
    """Several calls (the later ones hit the prefix cache), mixed lengths, a stop token that ends a request
    while its next step is already launched: tp=2 overlapped = tp=2 in turn = tp=1."""
    single = engines["single"]
    greedy = dict(temperature=0, output_logits=True)
    free = single.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    # a token first sampled third or later: as a stop token, it ends its request while the next step runs
    stop_prompt, stop_at = next((p, t) for p, o in zip(PROMPTS, free) for k, t in enumerate(o.token_ids)
                                if k >= 2 and t not in o.token_ids[:k])
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **greedy) for n in (3, 11, 1, 7)] + \
        [SamplingParams(max_tokens=9, stop_token_ids=[stop_at], **greedy), SamplingParams(max_tokens=5, **greedy)]
    prompts = PROMPTS[:4] + [stop_prompt, PROMPTS[4]]
    for _ in range(2):
        want = single.generate(prompts, params, use_tqdm=False)
        assert_same(want, engines["plain"].generate(prompts, params, use_tqdm=False))
        got = engines["fast"].generate(prompts, params, use_tqdm=False)
        assert_same(want, got)
    assert all(o.num_cached_tokens >= 32 for o in got[:2])  # the shared prompt's blocks, from the prefix cache
    assert want[4].finish_reason == "stop" and 3 <= len(want[4].token_ids) < 9
    assert_idle(engines["fast"])


def test_streams_and_aborts_leave_the_overlapped_engine_exact(engines):
    fast, single = engines["fast"], engines["single"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_logits=True)
    want = single.generate(PROMPTS[:2], params, use_tqdm=False)
    deltas = list(fast.stream(PROMPTS[0], params))
    assert [t for d in deltas for t in d.token_ids] == want[0].token_ids and deltas[-1].finished
    stream = fast.stream(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()  # an abort while a step is launched
    assert_idle(fast)
    interrupt_generate(fast, 4, PROMPTS, params)  # Ctrl-C at the 4th step: every request aborted
    assert_idle(fast)
    assert_same(single.generate(PROMPTS, params, use_tqdm=False), fast.generate(PROMPTS, params, use_tqdm=False))


def test_launch_does_not_wait_and_a_launched_steps_fault_surfaces_at_collect(ckpt):
    registry = Registry(load_entry_points=False)
    registry.add_plugin_module(helpers.ModelPlugin(helpers.SlowOrFailingOnRank1), "tests")
    llm = LLM(ckpt, registry=registry, parallel="tensor", tensor_parallel_size=2, overlap_steps=True,
              **helpers.ENGINE_OPTIONS)
    try:
        worker = llm.engine.worker
        pids, launches, real_launch = worker.worker_pids, [], worker.launch

        def timed_launch(step):
            start = time.perf_counter()
            real_launch(step)
            launches.append(time.perf_counter() - start)

        worker.launch = timed_launch
        start = time.perf_counter()
        out = llm.generate([[1, helpers.SLOW_TOKEN, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].token_ids) == 3 and time.perf_counter() - start >= helpers.SLOW_S
        assert len(launches) >= 3 and max(launches) < helpers.SLOW_S / 4  # rank 1 slept in the first step

        start = time.perf_counter()
        params = SamplingParams(temperature=0, max_tokens=2 * helpers.FAIL_POSITION, ignore_eos=True)
        with pytest.raises(WorkerError, match=r"(?s)rank 1 failed during 'collect' or the 'launch' before it; all "
                                              r"workers are stopped.*\[rank 1, call launch.*Traceback.*in forward.*"
                                              r"InjectedFault: injected fault at position 12 on rank 1"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert time.perf_counter() - start < DEADLINE_S
        with pytest.raises(WorkerError, match="workers are stopped.*create a new LLM"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
        assert gone(pids)
    finally:
        start = time.perf_counter()
        llm.close()
        assert time.perf_counter() - start < 30  # closed without hanging
