"""The scheduler and the block manager on their own: no model, a fake step that appends a token.

Checks what the engine-level equality tests cannot see directly: reference counts, which blocks a
prefix hit reuses, how prompts are cut into chunks, and that preemption loses, duplicates or
changes no request.
"""
from __future__ import annotations

import random

import pytest

from nanoplug.engine.blocks import BlockManager, block_hash
from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.engine.scheduler import Scheduler
from nanoplug.engine.sequence import Sequence, Status

BS = 4


def seq(tokens, max_tokens: int = 4, n: int = 1) -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens, n=n))


def prefilled(blocks: BlockManager, tokens) -> Sequence:
    """A sequence allocated, its whole prompt computed and its full blocks committed, as after a prefill."""
    s = seq(tokens)
    blocks.allocate(s)
    s.num_computed_tokens = len(s.token_ids)
    blocks.commit(s)
    return s


def scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(model="unused", kv_block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix_caching))


def check_invariants(blocks: BlockManager, live: list[Sequence]) -> None:
    """Reference counts equal the block tables that hold each block; every block is free or held."""
    held = [0] * blocks.num_blocks
    for s in live:
        for b in s.block_table:
            held[b] += 1
    assert held == blocks.ref_counts
    free = set(blocks.free_ids)
    assert len(free) == len(blocks.free_ids), "a block is free twice"
    assert free == {b for b in range(blocks.num_blocks) if held[b] == 0}
    for h, b in blocks.hash_to_block.items():
        assert blocks.hashes[b] == h


def fake_step(sched: Scheduler, next_token=lambda s: 1000 + len(s)) -> list[tuple[Sequence, int, bool]]:
    """Schedule one step, "compute" it, append a token to each sampled sequence, finish at max_tokens.

    Returns (sequence, tokens computed, whether it sampled) for each scheduled sequence."""
    batch, is_prefill = sched.schedule()
    plan = [(item.seq, item.num_tokens, item.samples) for item in batch]
    plan += [(child, 0, True) for item in batch for child in item.forks]  # n > 1: samples forked this step
    sched.advance(batch)
    for s, _, samples in plan:
        if samples:
            s.token_ids.append(next_token(s))
        sched.blocks.commit(s)  # as the engine does: full blocks register once their tokens are known
        if samples and s.num_completion_tokens >= s.params.max_tokens:
            sched.finish(s)
    return plan


# ---------------------------------------------------------------------------------- blocks
def test_block_hash_chains_on_the_previous_block():
    assert block_hash(-1, [1, 2, 3, 4]) == block_hash(-1, [1, 2, 3, 4])
    assert block_hash(-1, [1, 2, 3, 4]) != block_hash(7, [1, 2, 3, 4])
    assert block_hash(-1, [1, 2, 3, 4]) != block_hash(-1, [1, 2, 3, 5])


def test_allocate_free_and_reference_counts():
    blocks = BlockManager(8, BS)
    a = seq(range(10))  # 3 blocks
    blocks.allocate(a)
    assert len(a.block_table) == 3 and blocks.num_free_blocks == 5
    check_invariants(blocks, [a])
    blocks.free(a)
    assert blocks.num_free_blocks == 8 and a.block_table == []
    check_invariants(blocks, [])


def test_prefix_hits_reuse_committed_blocks_but_never_the_last_token_block():
    blocks = BlockManager(16, BS)
    a = prefilled(blocks, range(12))  # exactly 3 blocks
    assert len(a.block_hashes) == 3

    same = seq(range(12))  # 100% cached: the block holding the last token is recomputed
    hit = blocks.allocate(same)  # the tokens the hits hold: the scheduler counts them as computed
    assert same.block_table[:2] == a.block_table[:2] and same.block_table[2] != a.block_table[2]
    assert hit == same.num_cached_tokens == 8
    assert [blocks.ref_counts[b] for b in a.block_table] == [2, 2, 1]

    longer = seq(list(range(12)) + [99, 98])  # all three full blocks hit
    blocks.allocate(longer)
    assert longer.block_table[:3] == a.block_table and longer.num_cached_tokens == 12

    one_block = seq(range(4))  # a prompt exactly one block long: nothing to reuse
    blocks.allocate(one_block)
    assert one_block.num_cached_tokens == 0

    diverging = seq([0, 1, 2, 3, 4, 5, 6, 7, 50, 51])  # same first two blocks, different third
    blocks.allocate(diverging)
    assert diverging.block_table[:2] == a.block_table[:2] and diverging.num_cached_tokens == 8
    check_invariants(blocks, [a, same, longer, one_block, diverging])


def test_freed_blocks_stay_reusable_until_handed_out_again():
    blocks = BlockManager(4, BS)
    a = prefilled(blocks, range(9))
    first_two = a.block_table[:2]
    blocks.free(a)
    b = seq(range(9))
    assert blocks.can_allocate(b)  # 1 fresh block, 2 reclaimed from the free list: 3 <= 4
    blocks.allocate(b)
    assert b.block_table[:2] == first_two and b.num_cached_tokens == 8
    check_invariants(blocks, [b])
    blocks.free(b)
    big = seq(range(100, 116))  # takes every block: the cached prefix is evicted
    blocks.allocate(big)
    assert blocks.hash_to_block == {} or all(blocks.ref_counts[x] for x in blocks.hash_to_block.values())
    blocks.free(big)
    c = seq(range(9))
    blocks.allocate(c)
    assert c.num_cached_tokens == 0


def test_can_allocate_counts_reclaimed_hit_blocks_as_used():
    blocks = BlockManager(3, BS)
    a = prefilled(blocks, range(8))
    blocks.free(a)  # both blocks free, first one cached
    assert blocks.can_allocate(seq(range(12)))  # 1 hit (reclaimed) + 2 fresh = 3 blocks
    assert not blocks.can_allocate(seq(range(13)))  # 1 hit + 3 fresh > 3


def test_no_prefix_caching_never_hits():
    blocks = BlockManager(8, BS, enable_prefix_caching=False)
    a = prefilled(blocks, range(9))
    b = seq(range(9))
    blocks.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


# ------------------------------------------------------------------------------- scheduler
def test_prefill_chunks_under_the_token_budget_any_sequence():
    sched = scheduler(budget=10)
    a, b, c = seq(range(25)), seq(range(100, 108)), seq(range(200, 208))
    for s in (a, b, c):
        sched.add(s)
    plan = []
    names = {id(a): "a", id(b): "b", id(c): "c"}
    while any(len(s) == s.num_prompt_tokens for s in (a, b, c)):
        batch = fake_step(sched)
        assert sum(n for _, n, _ in batch) <= 10
        plan.append([(names[id(s)], n, samples) for s, n, samples in batch])
    assert plan == [
        [("a", 10, False)],
        [("a", 10, False)],
        [("a", 5, True), ("b", 5, False)],
        [("b", 3, True), ("c", 7, False)],  # b's second chunk, then c starts: not only the first is chunked
        [("a", 1, True), ("b", 1, True), ("c", 1, True)],  # c's last prompt token rides in the decode step
    ]
    assert [len(s) for s in (a, b, c)] == [27, 10, 9]  # a and b sampled in steps 3 and 4, then all decode


def test_decode_batches_every_running_sequence_under_max_num_seqs():
    sched = scheduler(max_num_seqs=3)
    seqs = [seq(range(i, i + 5), max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch = fake_step(sched)
    assert len(batch) == 3 and all(samples for _, _, samples in batch)  # only 3 admitted
    batch = fake_step(sched)
    assert [n for _, n, _ in batch] == [1, 1, 1]
    while sched.has_work():
        fake_step(sched)
    assert all(s.status is Status.FINISHED and s.num_completion_tokens == 3 for s in seqs)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_preemption_recomputes_without_losing_or_duplicating():
    sched = scheduler(num_blocks=6, budget=64)
    seqs = [seq(range(i * 10, i * 10 + 6), max_tokens=10) for i in range(3)]  # 16 tokens each = 4 blocks
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work():
        batch = fake_step(sched, next_token=lambda s: 5000 + s.num_completion_tokens)
        check_invariants(sched.blocks, list(sched.running))
        assert len({id(s) for s, _, _ in batch}) == len(batch)
        steps += 1
        assert steps < 500
    assert sched.num_preemptions > 0
    for i, s in enumerate(seqs):
        assert s.token_ids == list(range(i * 10, i * 10 + 6)) + [5000 + k for k in range(10)]
    assert sched.blocks.num_free_blocks == 6


def test_preempted_sequence_returns_to_the_front_and_starts_over():
    sched = scheduler(num_blocks=4, budget=64)
    a, b = seq(range(7), max_tokens=20), seq(range(100, 107), max_tokens=20)
    sched.add(a)
    sched.add(b)
    fake_step(sched)  # both prefilled: 2 blocks each, 8 tokens
    fake_step(sched)  # both decode their 8th token, which still fits in 2 blocks
    assert sched.num_preemptions == 0
    fake_step(sched)  # the 9th token: a needs a 3rd block, none is free, so b (the newest) goes
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.status is Status.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == [] and len(b) == 9
    assert a.status is Status.RUNNING and len(a) == 10
    fake_step(sched)  # b cannot come back while a holds 3 of the 4 blocks: a decodes on alone
    assert list(sched.waiting) == [b] and len(a) == 11


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_keeps_every_invariant(seed, prefix_caching):
    """Random prompts (many sharing prefixes, some sampled several times), budgets and cache sizes, run to completion."""
    rng = random.Random(seed)
    sched = scheduler(num_blocks=rng.randint(8, 16), budget=rng.randint(3, 20), max_num_seqs=rng.randint(2, 6),
                      prefix_caching=prefix_caching)
    shared = [rng.randrange(50) for _ in range(12)]
    seqs = []
    for i in range(12):
        prompt = shared[: rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
        seqs.append(seq(prompt or [1], max_tokens=rng.randint(1, 12), n=rng.choice([1, 1, 2, 3])))
    expected = [[s.token_ids + [7000 + k for k in range(s.params.max_tokens)]] * s.params.n for s in seqs]
    pending = list(seqs)
    steps = 0
    while pending or sched.has_work():
        if pending and rng.random() < 0.5:  # requests arrive while others run
            sched.add(pending.pop(0))
        if not sched.has_work():
            continue
        fake_step(sched, next_token=lambda s: 7000 + s.num_completion_tokens)
        check_invariants(sched.blocks, list(sched.running))
        for s in sched.running:  # a running sequence's computed tokens fit in its blocks
            assert s.num_computed_tokens <= len(s.block_table) * BS
        steps += 1
        assert steps < 2000
    assert [[x.token_ids for x in s.samples] for s in seqs] == expected
    assert all(x.status is Status.FINISHED for s in seqs for x in s.samples)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_abort_gives_back_blocks_of_running_and_waiting_requests():
    sched = scheduler(num_blocks=8)
    a, b = seq(range(10)), seq(range(30))  # b waits: not enough blocks for both
    sched.add(a)
    sched.add(b)
    fake_step(sched)
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    sched.abort(a)
    sched.abort(b)
    assert not sched.has_work() and sched.blocks.num_free_blocks == 8
    assert a.finish_reason == b.finish_reason == "abort"


# ---------------------------------------------------------------------------------- n > 1
def test_fork_shares_full_prompt_blocks_and_copies_the_partial_one():
    blocks = BlockManager(8, BS)
    parent = seq(range(10), n=3)  # blocks: [0..3] [4..7] [8, 9, _, _]
    blocks.allocate(parent)
    kids = [parent.fork(1), parent.fork(2)]
    assert all(blocks.fork(parent, k) for k in kids)
    assert [k.block_table[:2] for k in kids] == [parent.block_table[:2]] * 2
    assert [blocks.ref_counts[b] for b in parent.block_table] == [3, 3, 1]
    assert blocks.take_copies() == [(parent.block_table[2], kids[0].block_table[2]),
                                    (parent.block_table[2], kids[1].block_table[2])]
    assert blocks.take_copies() == []
    assert all(k.num_cached_tokens == parent.num_cached_tokens and k.params.n == 3 and k.root is parent for k in kids)
    assert [s.sample_index for s in parent.samples] == [0, 1, 2]
    check_invariants(blocks, [parent, *kids])
    whole = seq(range(8), n=2)  # the prompt fills its blocks: nothing to copy, nothing new
    blocks.allocate(whole)
    kid = whole.fork(1)
    assert blocks.fork(whole, kid) and kid.block_table == whole.block_table and blocks.take_copies() == []
    for s in (parent, *kids, whole, kid):
        blocks.free(s)
    assert blocks.num_free_blocks == 8 and set(blocks.ref_counts) == {0}


def test_fork_without_a_free_block_changes_nothing():
    blocks = BlockManager(3, BS)
    parent = seq(range(10), n=2)
    blocks.allocate(parent)
    kid = parent.fork(1)
    assert not blocks.fork(parent, kid)
    assert kid.block_table == [] and blocks.ref_counts == [1, 1, 1] and blocks.take_copies() == []


def test_forked_seeds_move_on_by_the_sample_index():
    parent = Sequence([1, 2, 3], SamplingParams(n=3, seed=40))
    assert [parent.fork(i).params.seed for i in (1, 2)] == [41, 42]
    assert Sequence([1], SamplingParams(n=2)).fork(1).params.seed is None


def test_samples_without_room_wait_as_plain_prompts_and_reuse_the_prompt_blocks():
    sched = scheduler(num_blocks=8, max_num_seqs=2)
    root = seq(range(9), max_tokens=2, n=4)
    sched.add(root)
    plan = fake_step(sched)  # the prefill: one sample joins the root, two wait
    assert [(s.sample_index, n) for s, n, _ in plan] == [(0, 9), (1, 0)]
    assert [s.sample_index for s in sched.waiting] == [2, 3]
    assert all(s.forks_left == 0 for s in root.samples)
    while sched.has_work():
        fake_step(sched)
        check_invariants(sched.blocks, list(sched.running))
    assert [s.token_ids for s in root.samples] == [list(range(9)) + [1009, 1010]] * 4
    assert max(s.num_cached_tokens for s in root.samples[2:]) == 8  # the waiting ones hit the prompt's full blocks
    assert sched.blocks.num_free_blocks == 8


def test_abort_of_the_first_sample_takes_every_sample():
    sched = scheduler()
    root = seq(range(6), max_tokens=8, n=3)
    sched.add(root)
    fake_step(sched)
    assert len(sched.running) == 3
    sched.abort(root)
    assert not sched.has_work() and root.request_finished
    assert {s.finish_reason for s in root.samples} == {"abort"}
    assert sched.blocks.num_free_blocks == 64
