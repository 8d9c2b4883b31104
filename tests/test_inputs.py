"""A step's inputs are planned in one place (nanoplug/worker/inputs.py) for eager steps and graph replays.

The planner's padded form (a graph's buffers: rows past the batch write to the scratch block) must give
the eager form's values for the batch's rows; and a platform whose "graphs" replay decode steps on such
buffers (here a test-only platform on the CPU that runs the model on them eagerly, as DecodeGraphs runs
its CUDA graphs) must give the eager engine's tokens and logits, overlapped steps included."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from _checkpoints import PROMPTS, checkpoint
from nanoplug import LLM, SamplingParams
from nanoplug.api import (PLUGIN_API_VERSION, AttentionMetadata, PrefillGraphs, SamplingBatch, StepBatch, StepGraphs,
                          StepInputs, hookimpl)
from nanoplug.worker.inputs import plan_fresh_prefill, plan_inputs
from nanoplug.engine.registry import Registry
from nanoplug.plugins.attention.manual import ManualAttention
from nanoplug.plugins.attention.sdpa import SdpaAttention
from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

BS, SCRATCH = 4, 50


def decode_batch(starts: list[int], tables: list[list[int]]) -> StepBatch:
    n = len(starts)
    return StepBatch(False, [100 + i for i in range(n)], starts, [1] * n, tables, list(range(n)),
                     SamplingBatch.greedy(n), from_previous_at=[1], from_previous_rows=[0])


def buffers(rows: int, width: int) -> StepInputs:
    h64, h32 = np.full((5, rows), -7, dtype=np.int64), np.full(2 * rows + 1 + rows * width, -7, dtype=np.int32)
    return StepInputs(input_ids=h64[0], positions=h64[1], slot_mapping=h64[2], from_previous_at=h64[3],
                      from_previous_rows=h64[4], seq_lens=h32[:rows], cu_seqlens_k=h32[rows:2 * rows + 1],
                      block_tables=h32[2 * rows + 1:].reshape(rows, width), cu_seqlens_q=np.arange(rows + 1))


def test_the_padded_plan_is_the_eager_plan_plus_padding_that_writes_to_the_scratch_block():
    batch = decode_batch([5, 0, 11], [[3, 7], [9], [1, 2, 4]])
    eager = plan_inputs(batch, BS, SCRATCH)
    assert eager.block_tables.tolist() == [[3, 7, SCRATCH], [9, SCRATCH, SCRATCH], [1, 2, 4]]
    assert eager.positions.tolist() == [5, 0, 11] and eager.slot_mapping.tolist() == [7 * BS + 1, 9 * BS, 4 * BS + 3]
    assert eager.seq_lens.tolist() == [6, 1, 12] and eager.cu_seqlens_k.tolist() == [0, 6, 7, 19]
    rows = 4
    padded = plan_inputs(batch, BS, SCRATCH, out=buffers(8, 5), rows=rows)
    n = 3
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert getattr(padded, name)[:n].tolist() == getattr(eager, name).tolist(), name
    assert padded.block_tables[:n, :3].tolist() == eager.block_tables.tolist()
    assert (padded.block_tables[:rows, 3:] == SCRATCH).all() and (padded.block_tables[n:rows] == SCRATCH).all()
    assert padded.input_ids[n:rows].tolist() == [0] and padded.positions[n:rows].tolist() == [0]
    assert padded.slot_mapping[n:rows].tolist() == [SCRATCH * BS] and padded.seq_lens[n:rows].tolist() == [1]
    assert padded.cu_seqlens_k[:rows + 1].tolist() == [0, 6, 7, 19, 20]
    assert (padded.num_from_previous, padded.from_previous_at[0], padded.from_previous_rows[0]) == (1, 1, 0)
    assert (padded.seq_lens_host, padded.max_seqlen_k) == ([6, 1, 12, 1], 12)


def prefill_buffers(tokens: int, seqs: int) -> StepInputs:
    h64, h32 = np.full(3 * tokens + seqs, -7, dtype=np.int64), np.full(3 * seqs + 5, -7, dtype=np.int32)
    return StepInputs(input_ids=h64[:tokens], positions=h64[tokens:2 * tokens], slot_mapping=h64[2 * tokens:3 * tokens],
                      last_rows=h64[3 * tokens:], cu_seqlens_q=h32[:seqs + 2], cu_seqlens_k=h32[seqs + 2:2 * seqs + 4],
                      seq_lens=h32[2 * seqs + 4:], block_tables=None, from_previous_at=None, from_previous_rows=None)


def test_a_captured_prefill_plan_is_the_eager_plan_plus_one_padding_sequence():
    batch = StepBatch(True, list(range(100, 109)), [0, 0], [5, 4], [[3, 7], [9]], [0, 1], SamplingBatch.greedy(2))
    eager = plan_inputs(batch, BS, SCRATCH)
    padded = plan_fresh_prefill(batch, BS, SCRATCH, prefill_buffers(16, 4), 12)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert getattr(padded, name)[:9].tolist() == getattr(eager, name).tolist(), name
    assert padded.input_ids[9:12].tolist() == [0] * 3 and padded.positions[9:12].tolist() == [0] * 3
    assert padded.slot_mapping[9:12].tolist() == [SCRATCH * BS] * 3
    assert padded.input_ids[12:].tolist() == [-7] * 4  # past the bucket: never read
    assert padded.cu_seqlens_q.tolist() == padded.cu_seqlens_k.tolist() == [0, 5, 9, 12, 12, 12]
    assert padded.seq_lens.tolist() == padded.query_lens_host == padded.seq_lens_host == [5, 4, 3, 0, 0]
    assert padded.last_rows.tolist() == [4, 8, 0, 0]
    assert (padded.max_seqlen_q, padded.max_seqlen_k, padded.num_from_previous) == (12, 12, 0)
    with pytest.raises(ValueError, match="start at 0"):  # cached context: never a captured prefill
        plan_fresh_prefill(StepBatch(True, [1, 2], [3], [2], [[3, 7]], [0], SamplingBatch.greedy(1)),
                           BS, SCRATCH, prefill_buffers(16, 4), 16)


# ------------------------------------------------------------------------ graphs on the CPU
class EagerReplays(StepGraphs):
    """DecodeGraphs' design without CUDA: one pair of static input buffers the engine plans into, one
    static metadata per batch size over them, and the model run on them (eagerly) at each replay."""

    SIZES = (1, 2, 4, 8)

    def __init__(self, forward, ctx, limits, scratch_block):
        self.forward, self.ctx, self.scratch_slot = forward, ctx, scratch_block * limits.block_size
        max_bs, width = self.SIZES[-1], (limits.max_model_len + limits.block_size - 1) // limits.block_size
        self.h64 = torch.zeros(5, max_bs, dtype=torch.int64)
        self.h32 = torch.zeros(2 * max_bs + 1 + max_bs * width, dtype=torch.int32)
        h32 = self.h32
        self.static = StepInputs(
            input_ids=self.h64[0].numpy(), positions=self.h64[1].numpy(), slot_mapping=self.h64[2].numpy(),
            from_previous_at=self.h64[3].numpy(), from_previous_rows=self.h64[4].numpy(),
            seq_lens=h32[:max_bs].numpy(), cu_seqlens_k=h32[max_bs:2 * max_bs + 1].numpy(),
            block_tables=h32[2 * max_bs + 1:].view(max_bs, width).numpy(), cu_seqlens_q=np.arange(max_bs + 1))
        cu_q = torch.arange(max_bs + 1, dtype=torch.int32)
        self.metas = {size: AttentionMetadata(
            is_prefill=False, cu_seqlens_q=cu_q[:size + 1], cu_seqlens_k=h32[max_bs:max_bs + size + 1],
            seq_lens=h32[:size], slot_mapping=self.h64[2, :size], block_tables=h32[2 * max_bs + 1:].view(max_bs, width)[:size],
            max_seqlen_q=1, max_seqlen_k=limits.max_model_len) for size in self.SIZES}
        self.replayed: list[tuple[int, int]] = []  # (size, sequences) of each replay

    def size_for(self, num_seqs):
        return next((s for s in self.SIZES if s >= num_seqs), None)

    def inputs(self, size):
        return self.static

    def replay(self, size, inputs, previous_tokens):
        k = inputs.num_from_previous
        if k:
            self.h64[0].index_copy_(0, self.h64[3, :k], previous_tokens.index_select(0, self.h64[4, :k]))
        meta = self.metas[size]
        meta.query_lens_host, meta.seq_lens_host, meta.max_seqlen_k = inputs.query_lens_host, inputs.seq_lens_host, inputs.max_seqlen_k
        self.ctx.set_step(meta)
        self.replayed.append((size, int((inputs.slot_mapping[:size] != self.scratch_slot).sum())))
        return self.forward(self.h64[0, :size], self.h64[1, :size])


class GraphsOnCpu(CpuPlatform):
    """Starts as the cuda platform does (the cache sized after a profiling step, a warm-up, then graphs),
    so the runner's start-up order is exercised on the CPU too."""

    description = "test-only: decode replayed on static buffers, as CUDA graphs are"

    def num_kv_blocks(self, block_bytes, profile, release):
        profile()  # the largest step, on a temporary cache
        release()
        return 64

    def warm_up(self, run, limits, num_blocks):
        self.warmed = [run(StepBatch(True, [0] * 3, [0], [3], [[0]], [0], SamplingBatch.greedy(1))),
                       run(StepBatch(False, [0], [3], [1], [[0]], [0], SamplingBatch.greedy(1)))]

    def capture_graphs(self, forward, ctx, limits, scratch_block, prefill_forward=None):
        self.graphs = EagerReplays(forward, ctx, limits, scratch_block)
        if prefill_forward is not None:
            self.graphs.prefill = EagerPrefillReplays(prefill_forward, ctx, limits, scratch_block)
        return self.graphs


class EagerPrefillReplays(PrefillGraphs):
    """CudaPrefillGraphs' design without CUDA: static buffers for the largest token count, one static
    metadata per count over them, and the model run on them (eagerly) at each replay."""

    sizes = (16, 32, 64, 128)
    max_seqs = 3

    def __init__(self, forward, ctx, limits, scratch_block):
        self.forward, self.ctx, self.scratch_slot = forward, ctx, scratch_block * limits.block_size
        t, s = self.sizes[-1], self.max_seqs
        self.h64, self.h32 = torch.zeros(3 * t + s, dtype=torch.int64), torch.zeros(3 * s + 5, dtype=torch.int32)
        h64, h32 = self.h64, self.h32
        self.static = StepInputs(
            input_ids=h64[:t].numpy(), positions=h64[t:2 * t].numpy(), slot_mapping=h64[2 * t:3 * t].numpy(),
            last_rows=h64[3 * t:].numpy(), cu_seqlens_q=h32[:s + 2].numpy(), cu_seqlens_k=h32[s + 2:2 * s + 4].numpy(),
            seq_lens=h32[2 * s + 4:].numpy(), block_tables=None, from_previous_at=None, from_previous_rows=None)
        table = torch.full((s + 1, 1), scratch_block, dtype=torch.int32)
        self.metas = {size: AttentionMetadata(
            is_prefill=True, cu_seqlens_q=h32[:s + 2], cu_seqlens_k=h32[s + 2:2 * s + 4], seq_lens=h32[2 * s + 4:],
            slot_mapping=h64[2 * t:2 * t + size], block_tables=table, max_seqlen_q=size, max_seqlen_k=size)
            for size in self.sizes}
        self.replayed: list[tuple[int, int]] = []  # (size, tokens of the step's sequences) of each replay

    def inputs(self, size):
        return self.static

    def replay(self, size, inputs):
        meta = self.metas[size]
        meta.query_lens_host, meta.seq_lens_host = inputs.query_lens_host, inputs.seq_lens_host
        self.ctx.set_step(meta)
        self.replayed.append((size, int((inputs.slot_mapping[:size] != self.scratch_slot).sum())))
        t = self.sizes[-1]
        return self.forward(self.h64[:size], self.h64[t:t + size], self.h64[3 * t:])


class CapturableManual(ManualAttention):
    supports_cuda_graphs = True  # reads the step's metadata afresh in prepare: replays see new inputs
    supports_prefill_graphs = True


class CapturableSdpa(SdpaAttention):
    supports_cuda_graphs = True
    supports_prefill_graphs = True


@pytest.fixture(scope="module")
def registry():
    module = types.ModuleType("graphs_on_cpu")
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION
    module.nanoplug_register_platform = hookimpl(lambda register: register.add("cpu_graphs", GraphsOnCpu))
    module.nanoplug_register_attention = hookimpl(lambda register: (register.add("manual_graphs", CapturableManual),
                                                                    register.add("sdpa_graphs", CapturableSdpa)))
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(module, "test")
    return reg


@pytest.mark.parametrize("attention,overlap", [("manual", False), ("sdpa", False), ("sdpa", True)])
def test_replays_on_padded_buffers_give_the_eager_engines_outputs(registry, attention, overlap):
    options = dict(kv_block_size=16, kv_cache="torch", max_model_len=256, device="cpu", dtype="float32",
                   max_num_seqs=8, max_num_batched_tokens=512, overlap_steps=overlap)
    eager = LLM(checkpoint(), registry=registry, attention=attention, num_kv_blocks=64, **options)
    graphs = LLM(checkpoint(), registry=registry, attention=f"{attention}_graphs", platform="cpu_graphs", **options)
    platform = graphs.engine.worker.platform
    assert graphs.engine.num_kv_blocks == 64 and [len(r.tokens) for r in platform.warmed] == [1, 1]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, output_logits=True) for i in range(7)]
    prompts = (PROMPTS * 2)[:7]  # 7 sequences finishing one after another: decode batches of 7 down to 1
    for a, b in zip(eager.generate(prompts, params, use_tqdm=False), graphs.generate(prompts, params, use_tqdm=False)):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    replayed = platform.graphs.replayed
    assert {size for size, _ in replayed} >= {8, 4, 2, 1} and any(size > n for size, n in replayed)  # padded replays


@pytest.mark.parametrize("attention,overlap", [("manual", False), ("sdpa", True)])
def test_prefill_replays_on_padded_buffers_give_the_eager_engines_outputs(registry, attention, overlap):
    options = dict(kv_block_size=16, kv_cache="torch", max_model_len=256, device="cpu", dtype="float32",
                   max_num_seqs=8, max_num_batched_tokens=512, overlap_steps=overlap, enable_prefix_caching=False)
    eager = LLM(checkpoint(), registry=registry, attention=attention, num_kv_blocks=64, **options)
    graphs = LLM(checkpoint(), registry=registry, attention=f"{attention}_graphs", platform="cpu_graphs", **options)
    prefill = graphs.engine.worker.graphs.prefill
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_logits=True)
    batches = [PROMPTS[:1], PROMPTS[1:3], PROMPTS[:3], PROMPTS[:5]]  # the last: more sequences than a graph takes
    for prompts in batches:
        for a, b in zip(eager.generate(prompts, params, use_tqdm=False), graphs.generate(prompts, params, use_tqdm=False)):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logits, b.logits, strict=True):
                torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    stats = graphs.engine.worker.report().stats
    assert stats.prefill_graph_replays == len(prefill.replayed) == 3  # the 5-sequence prefill ran eager
    assert all(size > n for size, n in prefill.replayed)  # padded: a padding sequence took the rest


def test_prefix_cache_hits_and_prompt_logprobs_run_their_prefill_eager(registry):
    """A prefill that starts past position 0 (a prefix-cache hit) or scores its prompt is never a captured one."""
    options = dict(kv_block_size=16, kv_cache="torch", max_model_len=256, device="cpu", dtype="float32",
                   max_num_seqs=8, max_num_batched_tokens=512, overlap_steps=False)
    eager = LLM(checkpoint(), registry=registry, attention="sdpa", num_kv_blocks=64, **options)
    graphs = LLM(checkpoint(), registry=registry, attention="sdpa_graphs", platform="cpu_graphs", **options)
    prefill = graphs.engine.worker.graphs.prefill
    prompt = PROMPTS[2] * 2  # two full blocks and more: a second run finds them cached
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_logits=True)
    scored = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    runs = []
    for llm in (eager, graphs):
        first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
        assert again.num_cached_tokens >= 32  # the second prefill started past position 0
        runs.append((first, again, llm.generate([PROMPTS[0]], scored, use_tqdm=False)[0]))
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
    for la, lb in zip(runs[0][1].logits, runs[1][1].logits, strict=True):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    assert runs[0][2].prompt_logprobs == runs[1][2].prompt_logprobs
    assert len(prefill.replayed) == 1  # only the first, fresh prefill replayed
