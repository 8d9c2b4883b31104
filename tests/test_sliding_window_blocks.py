"""The KV blocks a sliding window has passed go back to the pool: on their own (the block manager), through the
engine (a Mistral-shape run holds about one window of blocks and still equals transformers, prefix hits
included), and the figure of a 32k-token sequence."""
from __future__ import annotations

import pytest

from _checkpoints import checkpoint, hf_greedy, tokenizer
from nanoplug import SamplingParams
from nanoplug.config import EngineConfig
from nanoplug.engine.blocks import BlockManager
from nanoplug.engine.scheduler import Scheduler
from nanoplug.engine.sequence import Sequence
from test_engine_vs_hf import STORY, engine

BS = 4


def decode_to(sched: Scheduler, seq: Sequence, length: int) -> list[int]:
    """Run `seq` (prompt scheduled in whole) to `length` tokens with a fake step; the blocks it holds after each."""
    held = []
    while len(seq) < length:
        batch, _ = sched.schedule()
        sampled = [item.seq for item in batch if item.samples]
        sched.advance(batch)
        for s in sampled:
            sched.append_token(s, 7)
        sched.commit(batch)
        held.append(sched.blocks.num_held(seq))
    return held


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_windowed_sequence_holds_about_one_window_of_blocks(prefix_caching):
    window, num_blocks = 10, 400
    config = EngineConfig(model="unused", kv_block_size=BS, max_num_batched_tokens=64, max_num_seqs=4,
                          max_model_len=2000)
    sched = Scheduler(config, BlockManager(num_blocks, BS, prefix_caching, window=window))
    seq = Sequence(list(range(30)), SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    sched.add(seq)
    held = decode_to(sched, seq, 1000)
    # the window's keys span at most ceil((window - 1) / BS) + 1 blocks, and the block being written
    assert max(held[5:]) <= (window - 1 + BS - 1) // BS + 2
    blocks = sched.blocks
    assert blocks.num_free_blocks == num_blocks - blocks.num_held(seq)
    assert all(b == blocks.released for b in seq.block_table[: len(seq.block_table) - blocks.num_held(seq)])
    sched.finish(seq)
    assert blocks.num_free_blocks == num_blocks and not any(blocks.ref_counts)


def test_no_block_is_released_when_a_layer_attends_to_everything():
    blocks = BlockManager(100, BS, True, window=None)
    seq = Sequence(list(range(60)), SamplingParams(temperature=0, max_tokens=4))
    blocks.allocate(seq)
    seq.num_computed_tokens = 60
    blocks.commit(seq)
    blocks.release_passed(seq)
    assert blocks.num_held(seq) == 15


def test_released_blocks_stay_reusable_as_a_prefix():
    """A prompt's blocks released by its window are still hit by a later prompt with the same prefix."""
    blocks = BlockManager(100, BS, True, window=6)
    first = Sequence(list(range(40)), SamplingParams(temperature=0, max_tokens=4))
    blocks.allocate(first)
    first.num_computed_tokens = 40
    blocks.commit(first)
    blocks.release_passed(first)
    assert blocks.num_held(first) < 10
    second = Sequence(list(range(40)) + [99], SamplingParams(temperature=0, max_tokens=4))
    assert blocks.allocate(second) == 40  # every full block of the shared prefix, released ones included
    blocks.release_passed(second)
    blocks.free(first)
    blocks.free(second)
    assert blocks.num_free_blocks == 100 and not any(blocks.ref_counts)


def test_mistral_engine_releases_blocks_and_still_equals_transformers():
    """Tiny Mistral (window 8, blocks of 16): a long generation gives blocks back as it goes, tokens equal to
    transformers', then the same prompt again hits the prefix cache."""
    llm = engine("mistral", attention="sdpa", max_num_batched_tokens=32)
    ids = tokenizer("mistral").encode(STORY)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    blocks = llm.engine.scheduler.blocks
    assert blocks.window == 8
    held = []
    original = blocks.release_passed

    def spy(seq):
        original(seq)
        held.append(blocks.num_held(seq))

    blocks.release_passed = spy
    out = llm.generate([ids], params, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy("mistral", ids, 60)
    total = (len(ids) + 60 + 15) // 16
    assert max(held[-20:]) <= 3 < total  # one window of 8 tokens spans at most two blocks, plus the next one
    again = llm.generate([ids], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == out.token_ids
    assert blocks.num_free_blocks == llm.engine.num_kv_blocks
