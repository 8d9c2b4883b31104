"""The batch builder (engine/batch.py) on its own, without a model: every row feature of a step lands in
the right rows of `StepBatch`, and the apply phase's bookkeeping (`Launched`) names each row's sequence."""
from __future__ import annotations

from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.engine.batch import BatchBuilder
from nanoplug.engine.blocks import BlockManager
from nanoplug.engine.scheduler import Scheduler
from nanoplug.engine.sequence import PENDING, Sequence


def test_every_row_feature_lands_in_its_rows_and_the_next_step_reads_the_placeholders():
    config = EngineConfig(model="unused", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=256, kv_block_size=4)
    scheduler = Scheduler(config, BlockManager(32, 4, enable_prefix_caching=False))
    builder = BatchBuilder(scheduler.blocks, scheduler.penalty_slots)
    forked = Sequence([1, 2, 3, 4, 5], SamplingParams(n=2, temperature=0.5, seed=3, prompt_logprobs=1), request_id="a")
    extras = Sequence([6, 7, 8], SamplingParams(presence_penalty=0.5, logprobs=2, logit_bias={9: 1.0},
                                                output_logits=True), request_id="b", adapter_id=1)
    scheduler.add(forked)
    scheduler.add(extras)
    batch, is_prefill = scheduler.schedule()
    launched = builder.build(batch, is_prefill, None)
    step, fork = launched.step, scheduler.take_forked()[0]
    assert is_prefill and step.input_ids == [1, 2, 3, 4, 5, 6, 7, 8] and step.query_lens == [5, 3]
    assert step.sample_rows == [0, 0, 1] and launched.sampled == [forked, fork, extras]  # n = 2: two rows on query row 0
    assert step.adapter_ids == [0, 1] and step.logits_rows == [2]
    sampling = step.sampling
    # (a fork draws with its own seed: seed + its sample index)
    assert sampling.temperatures == [0.5, 0.5, 1.0] and sampling.seeds == [3, 4, None] and sampling.positions == [5, 5, 3]
    assert sampling.logprob_rows == [2] and sampling.num_top_logprobs == [2]
    processing = sampling.processing
    assert processing.rows == [2] and processing.slots == [extras.penalty_slot] == [0] and processing.presence == [0.5]
    assert [(i.slot, i.prompt_token_ids, i.output_token_ids) for i in processing.inits] == [(0, [6, 7, 8], [])]
    assert (processing.bias_rows, processing.bias_token_ids, processing.bias_values) == ([2], [9], [1.0])
    scored = step.prompt_logprobs  # positions 0..3 score prompt tokens 1..4 of the first sequence
    assert (scored.at, scored.token_ids, scored.top) == ([0, 1, 2, 3], [2, 3, 4, 5], 1)
    assert launched.prompt_scored == [(forked, 0, 4)]

    scheduler.advance(batch, pending=True)  # overlapped: the sampled tokens are still on the device
    launched.number_rows()
    batch, is_prefill = scheduler.schedule()
    after = builder.build(batch, is_prefill, launched).step
    assert not is_prefill and after.input_ids == [PENDING] * 3 and after.prompt_logprobs is None
    assert after.from_previous_at == [0, 1, 2] and sorted(after.from_previous_rows) == [0, 1, 2]
    assert after.sampling.processing.inits == [] and after.sampling.processing.slots == [0]  # the slot is filled once


def test_a_plain_step_carries_no_feature_records():
    config = EngineConfig(model="unused", max_model_len=64, kv_block_size=4)
    scheduler = Scheduler(config, BlockManager(8, 4))
    scheduler.add(Sequence([1, 2, 3], SamplingParams(), request_id="plain"))
    batch, is_prefill = scheduler.schedule()
    step = BatchBuilder(scheduler.blocks, scheduler.penalty_slots).build(batch, is_prefill, None).step
    assert step.prompt_logprobs is None and step.sampling.processing is None and step.sampling.logprob_rows == []
    assert step.logits_rows == [] and step.from_previous_at == [] and step.block_copies == []
