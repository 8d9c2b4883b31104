"""The engine core on its own (add_request, abort and step from several threads) and `LLM` called from
several threads at once: requests of every caller join the same steps, each caller gets exactly its own
outputs, and nothing is lost or leaked (issue 13 item 1: two threads in generate used to corrupt a step)."""
from __future__ import annotations

import threading
import time

import pytest

from _checkpoints import PROMPTS, checkpoint
from _engine_checks import assert_idle
from nanoplug import LLM, SamplingParams
from nanoplug.errors import RequestError

OPTIONS = dict(kv_block_size=16, attention="sdpa", kv_cache="torch", num_kv_blocks=96, max_model_len=256)
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint(), **OPTIONS)


def alone(llm: LLM, prompt: str, max_tokens: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)[0].token_ids


def test_a_client_adds_and_aborts_from_two_threads_while_another_steps(llm):
    core = llm.engine
    seen: dict[str, list] = {}  # request id -> its updates, in order
    first_token = {}  # request id -> set when its first tokens came back
    done = threading.Event()

    def stepper():
        while not done.is_set() or core.has_unfinished():
            for u in core.step() if core.has_unfinished() else ():
                seen.setdefault(u.request_id, []).append(u)
                first_token.setdefault(u.request_id, threading.Event()).set()
            time.sleep(0)

    def client(name: str, prompts: list[str], abort_every_other: bool):
        for i, prompt in enumerate(prompts):
            keep = not (abort_every_other and i % 2)
            request = core.make_request(prompt, SamplingParams(max_tokens=8 if keep else 200, **GREEDY),
                                        request_id=f"{name}-{i}")
            first_token.setdefault(request.request_id, threading.Event())
            core.add_request(request)
            if not keep:  # abort it while it runs: once its first tokens are back
                assert first_token[request.request_id].wait(60)
                core.abort(request.request_id)

    step_thread = threading.Thread(target=stepper)
    step_thread.start()
    clients = [threading.Thread(target=client, args=("a", PROMPTS, True)),
               threading.Thread(target=client, args=("b", PROMPTS[::-1], False))]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    done.set()
    step_thread.join(120)
    assert not step_thread.is_alive() and not any(t.is_alive() for t in clients)
    assert set(seen) == {f"{n}-{i}" for n in "ab" for i in range(len(PROMPTS))}
    for request_id, updates in seen.items():
        assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]  # one last update each
        tokens = [t for u in updates for t in u.token_ids]
        name, i = request_id.split("-")
        prompt = (PROMPTS if name == "a" else PROMPTS[::-1])[int(i)]
        if name == "a" and int(i) % 2:
            assert updates[-1].finish_reason == "abort" and 0 < len(tokens) < 200
            assert tokens == alone(llm, prompt, len(tokens))  # what it had got was right
        else:
            assert updates[-1].finish_reason == "length" and tokens == alone(llm, prompt, 8)
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert_idle(llm)


def test_request_ids_are_checked_and_an_unknown_abort_is_harmless(llm):
    core = llm.engine
    request = core.make_request("Hello", SamplingParams(max_tokens=2, **GREEDY), request_id="same")
    core.add_request(request)
    with pytest.raises(RequestError, match="request id 'same' is already in use"):
        core.add_request(request)
    core.abort("never-added")
    updates = []
    while core.has_unfinished():
        updates += core.step()
    assert [u.request_id for u in updates if u.finished] == ["same"]
    core.add_request(request)  # a finished request's id may be used again
    while core.has_unfinished():
        core.step()
    assert_idle(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_threads_calling_generate_share_steps_and_each_gets_its_own_outputs(overlap):
    llm = LLM(checkpoint(), **OPTIONS, overlap_steps=overlap)
    threads = 4
    jobs = [(PROMPTS[i:] + PROMPTS[:i], 6 + 3 * i) for i in range(threads)]  # each thread its prompts and length
    want = [[alone(llm, p, n) for p in prompts] for prompts, n in jobs]
    owners_per_step: list[set[int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        batch, is_prefill = schedule()
        owners_per_step.append({item.seq.params.seed for item in batch})  # the seed names the calling thread
        return batch, is_prefill

    llm.engine.scheduler.schedule = recording_schedule
    got: list = [None] * threads
    errors: list = []
    start = threading.Barrier(threads)

    def caller(i: int):
        prompts, n = jobs[i]
        try:
            start.wait()
            got[i] = llm.generate(prompts, SamplingParams(max_tokens=n, seed=i, **GREEDY), use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    pool = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(300)
    assert not errors and not any(t.is_alive() for t in pool)
    assert max(map(len, owners_per_step)) == threads  # some step ran every caller's requests together
    for (prompts, n), outputs, expected in zip(jobs, got, want):
        assert [o.prompt for o in outputs] == prompts
        assert [o.token_ids for o in outputs] == expected and all(len(o.token_ids) == n for o in outputs)
    assert_idle(llm)


def test_a_stream_and_a_generate_in_two_threads(llm):
    params = SamplingParams(max_tokens=12, **GREEDY)
    want = {p: alone(llm, p, 12) for p in PROMPTS[:2]}
    streamed: list[int] = []
    errors: list = []

    def streamer():
        try:
            for delta in llm.stream(PROMPTS[0], params):
                streamed.extend(delta.token_ids)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=streamer)
    t.start()
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    t.join(120)
    assert not errors and streamed == want[PROMPTS[0]] and out[0].token_ids == want[PROMPTS[1]]
    assert_idle(llm)


def test_a_lone_caller_steps_on_its_own_thread():
    """No thread hand-off for a lone generate (a GIL switch per delivery): every step runs on the caller's
    thread, the driver's thread never starts, and a step that raises still reaches the caller."""
    llm = LLM(checkpoint(), **OPTIONS)
    stepping_threads = set()
    step = llm.engine.step

    def recording_step():
        stepping_threads.add(threading.current_thread().name)
        return step()

    llm.engine.step = recording_step
    out = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert all(len(o.token_ids) == 5 for o in out)
    assert stepping_threads == {threading.current_thread().name} and llm.driver._thread is None
    assert_idle(llm)

    def failing_step():
        raise RuntimeError("a kernel fell over")

    llm.engine.step = failing_step
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    llm.close()


def test_a_paused_stream_does_not_hold_up_a_caller_that_arrives_later(llm):
    """A stream stepping on its reader's thread, left unread, must not starve a second caller: its
    arrival hands the stepping to the driver's thread."""
    params = SamplingParams(max_tokens=40, **GREEDY)
    want = alone(llm, PROMPTS[1], 8)
    stream = llm.stream(PROMPTS[0], params)
    first = next(stream)  # the stream's reader now pauses
    assert first.token_ids
    got: list = []
    t = threading.Thread(target=lambda: got.append(
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)))
    t.start()
    t.join(120)
    assert not t.is_alive() and got[0][0].token_ids == want
    rest = [tok for d in stream for tok in d.token_ids]
    assert len(first.token_ids) + len(rest) == 40
    assert_idle(llm)
