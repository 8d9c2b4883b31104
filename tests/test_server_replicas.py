"""`nanoplug serve --data-parallel-size 2` on the CPU: two tiny engine replicas behind one front end.

Requests spread over both (greedy answers equal the Python API's), a shared prompt prefix sticks to one replica
(whose prefix cache then serves it: cached tokens in the usage), and a replica killed mid-request fails only its
own requests with a 503 naming it, is reported on /health, and the other serves on. The dispatch policy itself
(affinity, load balance, round robin) is checked without processes on `Replicas.pick`.
"""
from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from _checkpoints import PROMPTS, checkpoint
from _server import start_server
from nanoplug import LLM, SamplingParams
from nanoplug.server.replicas import PrefixAffinity, Replicas
from nanoplug.server.streams import Streams

ENGINE = dict(kv_block_size=16, num_kv_blocks=128, max_model_len=512, max_num_seqs=8)  # few batch sizes to record
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3  # > one 16-token block


@pytest.fixture(scope="module")
def server(request):
    return start_server(request, "--data-parallel-size", "2", engine=ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()


def sent(server) -> list[int]:
    return [r["requests"] for r in health(server)["replicas"]]


@pytest.mark.slow  # two engine processes start
def test_requests_spread_over_both_replicas_with_the_engines_answers(server, client):
    llm = LLM(checkpoint("qwen3"), **ENGINE)
    want = [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)]
    llm.close()
    before = sent(server)
    got = [client.completions.create(model=checkpoint("qwen3"), prompt=p, max_tokens=6, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == want
    after = sent(server)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # short prompts: the least loaded, in turn
    # each replica's live counts, for a gateway or a benchmark to see one replica queue while the other idles
    # (open at once; running and waiting as of each engine's next frame, sent when it goes idle)
    counts = lambda: [(r["open"], r["running"], r["waiting"]) for r in health(server)["replicas"]]  # noqa: E731
    deadline = time.monotonic() + 10
    while counts() != [(0, 0, 0)] * 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts() == [(0, 0, 0)] * 2


@pytest.mark.slow  # two engine processes start
def test_a_shared_prefix_sticks_to_one_replica_and_hits_its_cache(server, client):
    before = sent(server)
    cached = []
    for question in ("What is 2+2?", "Name a colour.", "Say hi.", "Count to three."):
        out = client.completions.create(model=checkpoint("qwen3"), prompt=SYSTEM + question, max_tokens=2)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    grew = [a - b for a, b in zip(sent(server), before)]
    assert sorted(grew) == [0, 4], grew
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached


@pytest.mark.slow  # two engine processes start
def test_a_killed_replica_fails_only_its_requests_and_shows_on_health(server, client):
    victim_prompt, other_prompt = "Once upon a time " * 12, "In a galaxy"  # the second: no block to follow
    results: dict = {}

    def stream(name: str, prompt: str) -> None:
        text = ""
        try:
            for chunk in client.completions.create(model=checkpoint("qwen3"), prompt=prompt, max_tokens=300,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text if chunk.choices else ""
                results.setdefault(name + "_started", True)
            results[name] = ("done", text)
        except openai.APIError as exc:
            results[name] = ("error", str(exc))

    before = sent(server)
    threads = [threading.Thread(target=stream, args=("victim", victim_prompt))]
    threads[0].start()
    deadline = time.monotonic() + 30
    while "victim_started" not in results and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = next(i for i, (a, b) in enumerate(zip(sent(server), before)) if a > b)
    threads.append(threading.Thread(target=stream, args=("other", other_prompt)))
    threads[1].start()
    while "other_started" not in results and time.monotonic() < deadline:
        time.sleep(0.01)
    engines = [p for p in psutil.Process(server.pid).children(recursive=True) if "engine_process" in " ".join(p.cmdline())]
    assert len(engines) == 2
    engines.sort(key=lambda p: p.create_time())  # replica 0 started first
    engines[victim].send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
    kind, message = results["victim"]
    assert kind == "error" and f"engine replica {victim}" in message, results["victim"]
    assert results["other"][0] == "done" and results["other"][1], results["other"]
    state = health(server)
    assert state["status"] == "degraded" and state["replicas"][victim]["status"] == "dead"
    assert state["replicas"][1 - victim]["status"] == "ok"
    for prompt in (victim_prompt, other_prompt, "fresh"):  # the survivor takes everything, the victim's prefix too
        assert client.completions.create(model=checkpoint("qwen3"), prompt=prompt, max_tokens=2).choices[0].text


# ------------------------------------------------------------------------------ the policy, without processes
class _Replica:
    failure = None
    max_num_seqs = 8


def _router(routing: str = "prefix", slack: int = 2) -> Replicas:
    router = Replicas.__new__(Replicas)
    router.replicas, router.routing, router.streams = [_Replica(), _Replica()], routing, Streams()
    router.affinity, router.balance_slack, router._next, router.dispatched = PrefixAffinity(4), slack, 0, [0, 0]
    return router


def _send(router: Replicas, prompt) -> int:
    chosen = router.pick(prompt)
    router.dispatched[chosen] += 1
    router.streams.register(f"r{sum(router.dispatched)}", owner=chosen)
    return chosen


def test_the_policy_follows_prefixes_then_load():
    router = _router(slack=1)
    a, b = "A" * 64 + "tail", "B" * 64 + "tail"  # four 16-character blocks each
    first = _send(router, a)
    assert _send(router, b) == 1 - first  # no match: the least loaded
    assert _send(router, a + " more") == first  # open: 2 there, 1 on the other
    assert _send(router, a) == first  # 2 open there against 1: within the slack of 1
    assert _send(router, a) == 1 - first  # 3 against 1: past the slack, the least loaded takes it
    assert PrefixAffinity(4).keys(list(range(40))) and not PrefixAffinity(4).keys("short")
    router.replicas[1 - first].failure = "gone"
    assert {_send(router, p) for p in (a, b, "c")} == {first}


def test_a_full_replica_passes_its_prefix_on_to_one_with_a_free_slot():
    router = _router(slack=100)  # the slack alone would never move a request
    router.replicas[0].max_num_seqs = router.replicas[1].max_num_seqs = 2
    a = "A" * 64
    first = _send(router, a)
    assert _send(router, a) == first  # a free slot there still: the prefix wins
    assert _send(router, a) == 1 - first  # full there, a free slot on the other: it goes there
    assert _send(router, "B" * 64) == 1 - first  # no match: the least loaded
    assert _send(router, a) == 1 - first  # both full: the slack decides, and the prefix was last computed there


def test_round_robin_ignores_prefixes():
    router = _router("round_robin")
    assert [_send(router, "A" * 64) for _ in range(4)] == [1, 0, 1, 0]
