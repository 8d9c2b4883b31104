"""KV-cache groups of models that mix sliding-window and full layers (api/step.py KVGroups, engine/hybrid_blocks.py):
how layers are grouped, a windowed group holding only its window while the full group keeps everything, prefix
hits that need only a window's blocks, the engine's cache of num_slots tensors through the `cpu` backend, and the
Gemma-3-shape figure of benchmarks/kv_windows.py. (Greedy equality with transformers on every scheduler path, the
hybrid models Gemma-2, Gemma-3 and Qwen2 with max_window_layers included, is tests/test_sliding_window_models.py.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nanoplug import SamplingParams
from nanoplug.api.step import kv_groups
from nanoplug.config import EngineConfig
from nanoplug.engine.hybrid_blocks import HybridBlockManager, block_manager_for
from nanoplug.engine.scheduler import Scheduler
from nanoplug.engine.sequence import Sequence
from test_engine_vs_hf import GREEDY, cache_prompts, engine, reference, tokens_of
from test_sliding_window_blocks import decode_to

BS = 4


def test_layers_form_groups_of_the_smallest_kind():
    gemma3 = kv_groups(tuple(None if i % 6 == 5 else 1024 for i in range(62)), 62)
    assert gemma3.windows == (None,) + (1024,) * 6 and gemma3.num_slots == 10
    assert sorted(gemma3.layer_slot[i] for i in range(62) if gemma3.layer_group[i] == 0) == list(range(10))
    gemma2 = kv_groups((8, None) * 3, 6)
    assert gemma2.windows == (None, 8) and gemma2.layer_group == (1, 0) * 3 and gemma2.layer_slot == (0, 0, 1, 1, 2, 2)
    mistral = kv_groups((8,) * 4, 4)
    assert not mistral.hybrid and mistral.layer_slot == (0, 1, 2, 3) and mistral.num_slots == 4
    assert type(block_manager_for(10, BS, True, (8,) * 4, 4)).__name__ == "BlockManager"


def hybrid(num_blocks: int, windows=(8, 8, None), prefix_caching: bool = True) -> HybridBlockManager:
    return HybridBlockManager(num_blocks, BS, prefix_caching, kv_groups(windows, len(windows)))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_windowed_groups_hold_their_window_and_the_full_group_everything(prefix_caching):
    blocks = hybrid(600, prefix_caching=prefix_caching)
    config = EngineConfig(model="unused", kv_block_size=BS, max_num_batched_tokens=64, max_num_seqs=4,
                          max_model_len=2000)
    sched = Scheduler(config, blocks)
    seq = Sequence(list(range(30)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    sched.add(seq)
    decode_to(sched, seq, 400)
    full, *windowed = blocks.tables(seq)
    assert blocks.released not in full and len(full) == 100
    for table in windowed:
        assert len(table) == 100 and sum(b != blocks.released for b in table) <= (8 - 1 + BS - 1) // BS + 2
    assert blocks.num_free_blocks == 600 - blocks.num_held(seq)
    sched.finish(seq)
    assert blocks.num_free_blocks == 600 and not any(blocks.ref_counts)


def test_a_prefix_hit_needs_only_the_windows_blocks():
    """The windowed groups' early blocks of a prompt are released and handed to another sequence (their hashes
    gone); a later prompt with the same prefix still hits all of it: the full group's blocks, and the windowed
    groups' blocks of the window only."""
    blocks = hybrid(80)
    first = Sequence(list(range(40)), SamplingParams(temperature=0, max_tokens=4))
    blocks.allocate(first)
    first.num_computed_tokens = 40
    blocks.commit(first)
    blocks.release_passed(first)
    held = blocks.num_held(first)
    assert held < 30
    filler = Sequence(list(range(1000, 1000 + BS * (blocks.num_free_blocks // 3))), SamplingParams(max_tokens=1))
    blocks.allocate(filler)  # takes every free block, the released ones too
    blocks.free(filler)
    second = Sequence(list(range(40)) + [99], SamplingParams(temperature=0, max_tokens=4))
    assert blocks.can_allocate(second)
    assert blocks.allocate(second) == 40
    for table, window in zip(blocks.tables(second), blocks.windows):
        live = [b for b in table[:10] if b != blocks.released]
        assert len(live) == (10 if window is None else 10 - (40 - 8 + 1) // BS)
        assert all(blocks.ref_counts[b] == 2 for b in live)  # shared with the first prompt
    blocks.free(first)
    blocks.free(second)
    assert blocks.num_free_blocks == 80 and not any(blocks.ref_counts)


def test_a_fork_shares_each_groups_full_blocks_and_copies_its_partial_one():
    blocks = hybrid(40)
    parent = Sequence(list(range(10)), SamplingParams(temperature=0, max_tokens=4, n=2))
    blocks.allocate(parent)
    child = parent.fork(1)
    assert blocks.fork(parent, child)
    copies = blocks.take_copies()
    assert len(copies) == 3  # the block holding token 9, in each group
    for mine, theirs, (src, dst) in zip(blocks.tables(child), blocks.tables(parent), copies):
        assert mine[:2] == theirs[:2] and mine[2] == dst and theirs[2] == src
    blocks.free(parent)
    blocks.free(child)
    assert blocks.num_free_blocks == 40 and not any(blocks.ref_counts)


@pytest.mark.slow
def test_the_cpu_backend_serves_a_hybrid_model_and_equals_transformers():
    """Qwen2 with max_window_layers (layer 0 full, layer 1 windowed): two groups of one slot, each read through a
    `cpu` backend of its own (the C++ kernel on the full group's decode), equal to transformers."""
    from nanoplug.kernels import cpu as cpu_kernels

    if cpu_kernels.unavailable() is not None:
        pytest.skip(cpu_kernels.unavailable())
    llm = engine("qwen2_swa_dim64", attention="cpu", max_num_batched_tokens=24)
    worker = llm.engine.worker
    assert worker.kv_groups.windows == (None, 8) and worker.kv_cache.shape[1] == 1 and len(worker.group_ctxs) == 2
    prompts = cache_prompts("qwen2_swa_dim64")
    assert tokens_of(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference("qwen2_swa_dim64",
                                                                                GREEDY.max_tokens, "cache")
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.slow
def test_a_gemma3_shape_sequence_holds_at_most_a_quarter_of_full_attention():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import kv_windows

    held, _, full = kv_windows.held_blocks(kv_windows.SHAPES["Gemma-3-27B (62 layers: 5 local of window 1024, then 1 global)"])
    assert held / full <= 0.25


def test_compare_refuses_a_hybrid_model_naming_generate():
    from _checkpoints import checkpoint
    from nanoplug.cli import compare

    outcome = compare.run_backend(checkpoint("qwen2_swa"), "sdpa", device="cpu", dtype="float32")
    assert outcome.error is not None and "KV group" in outcome.error and "generate" in outcome.error
