"""Property tests (Hypothesis) of the scheduler and the block manager: random streams of requests
with aborts, preemption (a small KV pool), prefix sharing and chunked prefill, in plain and in
overlapped steps, never lose or leak a block, never change a request's greedy tokens, and leave the
pool empty at the end.

The scheduler is driven as the engine drives it (`Driver.step` follows `LLM.step`/`_resolve`/
`_check_finish`: overlapped, a sampled token reaches the host one step later). The fake device's KV
cache holds in each slot what real K/V depend on: the adapter and every token up to that position.
Its "model" reads a sequence's whole context back through the block table before it samples, and
the token it returns is a function of that context, so a block shared, reused, evicted or freed at
the wrong time shows up as a wrong slot in the step that reads it, and every request's tokens are
known in advance (iterate the function on its prompt).

One tiny real engine (random weights) then runs a few such streams through `LLM.stream`, pulled in a
random order and some abandoned midway (an abort), plain and overlapped, against the tokens of an
engine with room for everything and no prefix cache.

Budgets: the `nanoplug-ci` profile (the default) is derandomized, so CI and every machine run the
same examples and a failure reproduces; `NANOPLUG_HYPOTHESIS=explore` draws new random examples
and `NANOPLUG_HYPOTHESIS=long` many more, for a search before a release.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanoplug.engine.blocks import BlockManager
from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.engine.scheduler import Scheduled, Scheduler
from nanoplug.engine.sequence import PENDING, Sequence, Status

MODE = os.environ.get("NANOPLUG_HYPOTHESIS", "ci")
if MODE not in ("ci", "explore", "long"):
    raise ValueError(f"NANOPLUG_HYPOTHESIS={MODE!r}: use ci (the default: fixed examples), explore or long")
# No example database (nothing written into the checkout); a failure prints the example and its blob.
_common = dict(deadline=None, database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nanoplug-ci", max_examples=300, derandomize=True, **_common)  # ~3 s on CI
settings.register_profile("nanoplug-explore", max_examples=300, **_common)
settings.register_profile("nanoplug-long", max_examples=5000, **_common)  # ~2 min
PROFILE = settings.get_profile("nanoplug-" + MODE)
REAL_EXAMPLES = {"ci": 3, "explore": 10, "long": 100}[MODE]  # a few seconds each, besides the @example ones

VOCAB = 24  # small, so a request meets EOS now and then
EOS = 0
MAX_STEPS = 5000


def next_token(adapter: int, context: tuple[int, ...]) -> int:
    """The fake model: the greedy token after `context`, a fixed function of the adapter and every token."""
    return xxhash.xxh64(np.asarray((adapter, *context), dtype=np.int64).tobytes()).intdigest() % VOCAB


# ------------------------------------------------------------------------------ the scenario
@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    adapter: int
    arrive: int  # the step before which it is added
    abort_after: int | None  # steps after arriving at which its caller goes away (None: never)

    def expected(self, max_model_len: int) -> tuple[list[int], str]:
        """Its completion and finish reason, as the engine's stop rules give them for `next_token`."""
        context, out = list(self.prompt), []
        while True:
            token = next_token(self.adapter, tuple(context))
            context.append(token)
            out.append(token)
            if token == EOS and not self.ignore_eos:
                return out, "stop"
            if len(out) >= self.max_tokens or len(context) >= max_model_len:
                return out, "length"


@dataclass(frozen=True)
class Scenario:
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    prefix_caching: bool
    overlap: bool
    requests: tuple[Request, ...]


tokens = st.integers(1, VOCAB - 1)


@st.composite
def scenarios(draw) -> Scenario:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    fewest = -(-max_model_len // block_size)  # the engine refuses a pool that cannot hold one full sequence
    num_blocks = draw(st.integers(fewest, fewest + 10))  # near the fewest: preemption
    prefixes = draw(st.lists(st.lists(tokens, min_size=1, max_size=32), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        if requests and draw(st.integers(0, 3)) == 0:  # the same prompt again: every full block cached
            prompt = list(draw(st.sampled_from(requests)).prompt)
        else:
            prefix = draw(st.sampled_from(prefixes))
            cut = draw(st.just(len(prefix)) | st.integers(0, len(prefix)))  # often all of it: whole blocks shared
            prompt = prefix[:cut] + draw(st.lists(tokens, max_size=6))
        requests.append(Request(
            prompt=tuple((prompt or [1])[:max_model_len - 1]),
            max_tokens=draw(st.integers(1, 20)),
            ignore_eos=draw(st.booleans()),
            adapter=draw(st.integers(0, 1)),
            arrive=draw(st.integers(0, 16)),
            abort_after=draw(st.none() | st.integers(0, 25)),
        ))
    return Scenario(
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
        max_num_batched_tokens=draw(st.integers(1, 40)),  # small: prompts prefill in chunks
        max_num_seqs=draw(st.integers(1, 6)), prefix_caching=draw(st.booleans()), overlap=draw(st.booleans()),
        requests=tuple(requests),
    )


# ------------------------------------------------------------------------- device and driver
class FakeDevice:
    """A KV cache of (adapter, context) per slot, and a model that checks the whole context it reads."""

    def __init__(self, blocks: BlockManager, max_model_len: int):
        self.blocks, self.max_model_len = blocks, max_model_len
        self.bs = blocks.block_size
        self.slots: list[list[tuple | None]] = [[None] * self.bs for _ in range(blocks.num_blocks)]
        self.sampled: dict[tuple[int, int], int] = {}  # (seq_id, position) -> token: what a PENDING stands for

    def context(self, seq: Sequence, length: int) -> tuple[int, ...]:
        """The sequence's first `length` tokens as the device knows them (placeholders filled in)."""
        return tuple(self.sampled[(seq.seq_id, p)] if t == PENDING else t for p, t in enumerate(seq.token_ids[:length]))

    def run(self, batch: list[Scheduled]) -> list[int]:
        """Compute one step (called before `advance`, like the runner): store its K/V, then sample."""
        for b in self.blocks.take_new_blocks():  # the runner clears a block the first time it is handed out
            self.slots[b] = [None] * self.bs
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            assert item.num_tokens >= 1, "a sequence scheduled with no token to compute has no logits to sample"
            context = self.context(seq, start + item.num_tokens)
            for p in range(start, start + item.num_tokens):
                block = seq.block_table[p // self.bs]
                assert self.blocks.ref_counts[block] == 1, (
                    f"the step writes position {p} of sequence {seq.seq_id} into block {block}, "
                    f"which {self.blocks.ref_counts[block]} sequences hold")
                self.slots[block][p % self.bs] = (seq.adapter_id, context[:p + 1])
        out = []
        for item in batch:
            if not item.samples:
                continue
            seq = item.seq
            length = seq.num_computed_tokens + item.num_tokens
            # a token the request could never keep is wasted work (a finish found later, EOS, is not known here)
            assert length < self.max_model_len, f"sampling after {length} tokens, max_model_len {self.max_model_len}"
            assert length - seq.num_prompt_tokens < seq.params.max_tokens, "sampling past max_tokens"
            context = self.context(seq, length)
            for p in range(length):
                found = self.slots[seq.block_table[p // self.bs]][p % self.bs]
                assert found == (seq.adapter_id, context[:p + 1]), (
                    f"sequence {seq.seq_id} reads position {p} from block {seq.block_table[p // self.bs]}, "
                    f"which holds {found}, not its own K/V")
            token = next_token(seq.adapter_id, context)
            self.sampled[(seq.seq_id, length)] = token
            out.append(token)
        return out


class Driver:
    """Steps the scheduler as `LLM.step` does, plain or overlapped, with the fake device."""

    def __init__(self, sc: Scenario):
        config = EngineConfig(model="unused", kv_block_size=sc.block_size, max_model_len=sc.max_model_len,
                              max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs)
        self.blocks = BlockManager(sc.num_blocks, sc.block_size, sc.prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.device = FakeDevice(self.blocks, sc.max_model_len)
        self.overlap, self.max_model_len = sc.overlap, sc.max_model_len
        self.max_num_batched_tokens, self.max_num_seqs = sc.max_num_batched_tokens, sc.max_num_seqs
        self.in_flight: tuple | None = None
        self.stats: Counter = Counter()

    def busy(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def step(self) -> None:
        launched = None
        if self.scheduler.has_work():
            batch, is_prefill = self.scheduler.schedule()
            if batch:
                self._count(batch, is_prefill)
                sampled = [item.seq for item in batch if item.samples]
                tokens = self.device.run(batch)
                self.scheduler.advance(batch, pending=self.overlap)  # overlapped: placeholders for the tokens on their way
                launched = (batch, sampled, tokens)
        if not self.overlap:
            assert launched is not None, "the scheduler found nothing to run although requests wait"
            self._resolve(*launched)
            return
        previous, self.in_flight = self.in_flight, launched
        if previous is None:
            assert launched is not None, "the scheduler found nothing to run although requests wait"
            return
        self._resolve(*previous)

    def drain(self) -> None:
        previous, self.in_flight = self.in_flight, None
        if previous is not None:
            self._resolve(*previous)

    def _resolve(self, batch: list[Scheduled], sampled: list[Sequence], tokens: list[int]) -> None:
        got = []
        for seq, token in zip(sampled, tokens):
            if seq.status is Status.FINISHED:
                self.stats["ran ahead of its end"] += 1
                continue
            self.scheduler.append_token(seq, token)
            got.append((seq, token))
        self.scheduler.commit(batch)
        for seq, token in got:
            reason = None
            if token == EOS and not seq.params.ignore_eos:
                reason = "stop"
            elif seq.num_completion_tokens >= seq.params.max_tokens or seq.num_known_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self.scheduler.finish(seq, reason)

    def _count(self, batch: list[Scheduled], is_prefill: bool) -> None:
        """Check the step's limits; count what the examples reach."""
        assert sum(item.num_tokens for item in batch) <= self.max_num_batched_tokens, "over the token budget"
        assert len(batch) <= self.max_num_seqs and len(self.scheduler.running) <= self.max_num_seqs
        assert len({id(item.seq) for item in batch}) == len(batch), "a sequence twice in one step"
        assert all(item.seq.status is Status.RUNNING for item in batch)
        for item in batch:
            if is_prefill and not item.samples:
                self.stats["prompt chunks"] += 1
            if item.seq.num_cached_tokens and item.seq.num_computed_tokens == item.seq.num_cached_tokens:
                self.stats["prefix hits"] += 1


def check_blocks(blocks: BlockManager, seqs: list[Sequence], device: FakeDevice) -> None:
    """Reference counts equal the block tables holding each block; every block is free once or held;
    a block registered for prefix reuse holds (in the fake cache) the tokens it is registered with."""
    held = [0] * blocks.num_blocks
    for seq in seqs:
        if seq.status is not Status.RUNNING:
            assert seq.block_table == [], f"a {seq.status.name} sequence holds blocks {seq.block_table}"
        assert len(set(seq.block_table)) == len(seq.block_table), f"a block twice in one table: {seq.block_table}"
        assert len(seq.block_hashes) <= len(seq.block_table)
        assert seq.num_computed_tokens <= len(seq.block_table) * blocks.block_size
        for b in seq.block_table:
            held[b] += 1
    assert held == blocks.ref_counts, "reference counts differ from the block tables"
    assert len(set(blocks.free_ids)) == len(blocks.free_ids), "a block is free twice"
    assert set(blocks.free_ids) == {b for b, n in enumerate(held) if n == 0}, "a block is lost or free while held"
    for h, b in blocks.hash_to_block.items():
        assert blocks.hashes[b] == h
        stored = [slot[1][-1] if slot else None for slot in device.slots[b]]
        assert stored == blocks.tokens[b], f"block {b} is registered for {blocks.tokens[b]} but holds {stored}"


def run_scenario(sc: Scenario) -> Counter:
    """Run every request to its end; check blocks at every step and tokens at the end. Returns what happened."""
    driver = Driver(sc)
    seqs = [Sequence(list(r.prompt), SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos),
                     request_id=str(i), adapter_id=r.adapter) for i, r in enumerate(sc.requests)]
    aborted: set[int] = set()
    last_event = max(r.arrive + (r.abort_after or 0) for r in sc.requests)
    t = 0
    while t <= last_event or driver.busy():
        for i, r in enumerate(sc.requests):
            if t == r.arrive:
                driver.scheduler.add(seqs[i])
            if r.abort_after is not None and t == r.arrive + r.abort_after and seqs[i].status is not Status.FINISHED:
                driver.stats["aborted while " + ("running" if seqs[i].status is Status.RUNNING else "waiting")] += 1
                driver.scheduler.abort(seqs[i])
                aborted.add(i)
                check_blocks(driver.blocks, seqs, driver.device)
        if driver.busy():
            driver.step()
            check_blocks(driver.blocks, seqs, driver.device)
        t += 1
        assert t < MAX_STEPS, "no progress"
    driver.drain()

    assert not driver.scheduler.has_work()
    assert driver.blocks.num_free_blocks == sc.num_blocks and not any(driver.blocks.ref_counts), "blocks leaked"
    for i, (r, seq) in enumerate(zip(sc.requests, seqs)):
        want, reason = r.expected(sc.max_model_len)
        assert seq.status is Status.FINISHED and seq.num_pending == 0
        assert seq.token_ids[:seq.num_prompt_tokens] == list(r.prompt)
        if i in aborted:
            assert seq.finish_reason == "abort"
            assert seq.completion_token_ids == want[:len(seq.completion_token_ids)], f"request {i} changed"
        else:
            assert (seq.completion_token_ids, seq.finish_reason) == (want, reason), f"request {i} changed"
    driver.stats["preemptions"] += driver.scheduler.num_preemptions
    driver.stats["examples"] += 1
    return driver.stats


# ---------------------------------------------------------------------------------- the tests
def test_random_request_streams_keep_blocks_and_tokens():
    """The property, and a check that the examples reach what it is about (preemption, hits, chunks,
    aborts of running requests, overlapped steps that ran ahead of a request's end)."""
    seen: Counter = Counter()

    @settings(PROFILE)
    @given(scenarios())
    def check(sc: Scenario) -> None:
        seen.update(run_scenario(sc))

    check()
    for what in ("preemptions", "prefix hits", "prompt chunks", "aborted while running", "aborted while waiting",
                 "ran ahead of its end"):
        assert seen[what] > 0, f"no example had {what}: {dict(seen)}"


@pytest.mark.parametrize("overlap", [False, True])
def test_identical_prompts_arriving_together_and_after(overlap):
    """A handpicked case: 100% prefix hits (the last block recomputed) beside the request that filled them."""
    prompt = tuple(range(1, 17))
    requests = tuple(Request(prompt, max_tokens=6, ignore_eos=True, adapter=0, arrive=at, abort_after=None)
                     for at in (0, 0, 3, 9))
    stats = run_scenario(Scenario(block_size=4, num_blocks=12, max_model_len=32, max_num_batched_tokens=8,
                                  max_num_seqs=4, prefix_caching=True, overlap=overlap, requests=requests))
    assert stats["prefix hits"] >= 2


# ------------------------------------------------------------------------- one tiny real engine
REAL_BLOCK, REAL_MAX_LEN = 4, 24  # 6 blocks: two prompts of 12+ tokens cannot both grow


@pytest.fixture(scope="module")
def real_engines():
    """Two tight engines (plain, overlapped: 6 blocks, 6-token steps, prefix cache) and a roomy reference.

    Module-scoped, so every example runs on engines that earlier examples used: a leaked block or a
    stale cached prefix would show in the next one."""
    from _checkpoints import checkpoint
    from nanoplug import LLM

    common = dict(device="cpu", dtype="float32", attention="manual", kv_cache="torch", kv_block_size=REAL_BLOCK,
                  max_model_len=REAL_MAX_LEN)
    tight = {overlap: LLM(checkpoint("qwen3"), num_kv_blocks=REAL_MAX_LEN // REAL_BLOCK, max_num_batched_tokens=6,
                          enable_prefix_caching=True, overlap_steps=overlap, **common) for overlap in (False, True)}
    roomy = LLM(checkpoint("qwen3"), num_kv_blocks=64, max_num_batched_tokens=512, enable_prefix_caching=False,
                overlap_steps=False, **common)
    yield tight, roomy
    for llm in (*tight.values(), roomy):
        llm.close()


@st.composite
def real_workloads(draw):
    ids = st.integers(1, 5000)
    base = draw(st.lists(ids, min_size=12, max_size=14))
    prompts = [tuple(base[:draw(st.integers(8, len(base)))] + draw(st.lists(ids, max_size=3)))
               for _ in range(draw(st.integers(2, 4)))]
    n = len(prompts)
    return dict(
        prompts=prompts,
        max_tokens=[draw(st.integers(1, 6)) for _ in range(n)],
        abandon_after=[draw(st.none() | st.integers(1, 3)) for _ in range(n)],  # deltas before the caller leaves
        order=draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=4 * n)),  # which stream is read next
        overlap=draw(st.booleans()),
    )


# Certain to preempt (three 13-16 token requests in 6 blocks), share a prefix and abandon one midway.
REAL_EXAMPLE = dict(prompts=[tuple(range(100, 113)), tuple(range(100, 113)) + (7, 8, 9), tuple(range(300, 313))],
                    max_tokens=[6, 5, 6], abandon_after=[None, 2, None], order=[0, 1, 2, 1, 0, 2], overlap=False)


@pytest.mark.slow
def test_real_engine_streams_with_aborts_equal_the_roomy_engine(real_engines):
    from _engine_checks import assert_idle
    from nanoplug import SamplingParams

    tight, roomy = real_engines
    reference: dict[tuple, list[int]] = {}
    seen: Counter = Counter()

    @settings(PROFILE, max_examples=REAL_EXAMPLES)
    @given(real_workloads())
    @example(REAL_EXAMPLE)
    @example(dict(REAL_EXAMPLE, overlap=True))
    def check(w) -> None:
        llm = tight[w["overlap"]]
        preemptions = llm.engine.scheduler.num_preemptions
        streams = [llm.stream(list(p), SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                   for p, m in zip(w["prompts"], w["max_tokens"])]
        got = [[] for _ in streams]
        open_ = set(range(len(streams)))  # neither finished nor abandoned
        finished = set()

        def pull(i: int) -> None:
            delta = next(streams[i])
            got[i] += delta.token_ids
            if delta.finished:
                open_.discard(i)
                finished.add(i)
            elif w["abandon_after"][i] is not None and len(got[i]) >= w["abandon_after"][i]:
                streams[i].close()  # the caller goes away: the request is aborted, its blocks given back
                open_.discard(i)
                seen["abandoned"] += 1

        for i in w["order"]:
            if i in open_:
                pull(i)
        while open_:
            pull(min(open_))
        assert_idle(llm)
        seen["preemptions"] += llm.engine.scheduler.num_preemptions - preemptions
        for i, (prompt, m) in enumerate(zip(w["prompts"], w["max_tokens"])):
            if prompt not in reference:
                params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
                reference[prompt] = roomy.generate([list(prompt)], params, use_tqdm=False)[0].token_ids
            want = reference[prompt][:m]
            assert got[i] == (want if i in finished else want[:len(got[i])]), f"request {i} changed"

    check()
    assert seen["preemptions"] and seen["abandoned"], dict(seen)
