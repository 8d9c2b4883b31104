"""The batch builder: the one place that turns a schedule into a step's data (`StepBatch`) and the
bookkeeping the apply phase needs to give results back to their sequences (`Launched`).

Every feature that crosses the step row by row lives here, on both sides of the device: the sample
rows and their settings, n > 1 forks (several sample rows drawing from one query row), prompt
logprobs, penalties' token-count slots and the logit bias, per-request adapters, output logits and
logprobs, and, with overlapped steps, the placeholders of tokens still on the device. A new row
feature adds its rows in `BatchBuilder.build` and reads its results back in `Launched`.

`build` is the step loop's host work: one pass over the schedule, appending to plain lists; a
feature no request of the step uses costs one attribute test per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoplug.api import (DraftBatch, LogitsProcessingBatch, LogprobsTensors, PromptLogprobsBatch, SamplingBatch, SlotInit, StepBatch,
                          StepResult)
from nanoplug.engine.blocks import BlockManager
from nanoplug.engine.penalties import PenaltySlots, add_sample_row
from nanoplug.engine.scheduler import Scheduled
from nanoplug.engine.sequence import PENDING, Sequence
from nanoplug.worker.logprobs import token_logprobs

__all__ = ["BatchBuilder", "Launched"]


@dataclass
class Launched:
    """A step handed to the device: its schedule, its inputs, and each sampled sequence's row."""

    batch: list[Scheduled]
    step: StepBatch
    sampled: list[Sequence]  # the sequence of each sample row (n > 1: a fork puts several on one query row)
    prompt_scored: list[tuple[Sequence, int, int]]  # (sequence, first position, count) of the prompt logprobs
    row_of: dict[int, int]  # seq_id -> row of the step's sampled tokens (set once launched overlapped)
    masked: list[Sequence] | None = None  # structured outputs: the sequence of each of sampling.mask_rows
    # a speculative step: (sequence, first sample row, drafts) of each sample, its rows consecutive
    spans: list[tuple[Sequence, int, int]] | None = None

    def number_rows(self) -> None:
        """Record each sampled sequence's row, for the next step to read its placeholder token from."""
        self.row_of = {seq.seq_id: k for k, seq in enumerate(self.sampled)}

    def emitted(self, result: StepResult) -> tuple[list[tuple[Sequence, int, int]], list[tuple[Sequence, int, int]]]:
        """The (sequence, token, sample row) of each token the step gives, in order, and in a speculative step
        each sample's (sequence, drafts accepted, drafts): its rows up to its first rejected draft, that row's
        token included (or every draft and the bonus row's token)."""
        if self.spans is None:
            return [(seq, token, k) for k, (seq, token) in enumerate(zip(self.sampled, result.tokens))], []
        accepted = dict(zip(self.step.drafts.rows, result.accepted))
        got, settled = [], []
        for seq, row, k in self.spans:
            n = 0
            while n < k and accepted[row + n]:
                n += 1
            got.extend((seq, result.tokens[r], r) for r in range(row, row + n + 1))
            settled.append((seq, n, k))
        return got, settled

    def row_outputs(self, result: StepResult) -> tuple[dict | None, dict | None]:
        """The logits and the logprobs of the sample rows that asked for them, by row (None: no row did);
        the prompt logprobs the step scored are handed to their sequences here."""
        step = self.step
        logits_of = dict(zip(step.logits_rows, result.logits)) if step.logits_rows else None
        logprobs_of = None
        if result.logprobs is not None:
            rows = step.sampling.logprob_rows
            logprobs_of = dict(zip(rows, token_logprobs(result.logprobs, [result.tokens[k] for k in rows],
                                                        step.sampling.num_top_logprobs)))
        if result.prompt_logprobs is not None:
            _add_prompt_logprobs(self.prompt_scored, step, result.prompt_logprobs)
        return logits_of, logprobs_of


class BatchBuilder:
    """Builds each step's data from the scheduler's batch; the owner of every row feature (see the module)."""

    def __init__(self, blocks: BlockManager, penalty_slots: PenaltySlots, structured: Any = None,
                 masks_later: bool = False):
        """`structured`: the engine's StructuredOutputs (grammar masks of constrained rows); `masks_later`: an
        overlapped worker samples after its launch, so the masks follow it (EngineCore._sample_masked)."""
        self.blocks = blocks
        self.penalty_slots = penalty_slots
        self.structured = structured
        self.masks_later = masks_later

    def build(self, batch: list[Scheduled], is_prefill: bool, in_flight: Launched | None) -> Launched:
        """The step's data, with the sequence of each sample row and the prompt positions it scores.

        `in_flight`: the step still on the device (overlapped), whose sampled tokens this one reads."""
        input_ids, starts, q_lens, tables, rows, logits_rows = [], [], [], [], [], []
        temps, top_ks, top_ps, min_ps, seeds, positions, adapter_ids = [], [], [], [], [], [], []
        prev_at, prev_rows, sampled, prompt_scored = [], [], [], []
        processing, logprob_rows, num_top = None, [], []
        plp_at, plp_ids, plp_top = [], [], 0
        mask_rows, masked = [], []
        row_of = in_flight.row_of if in_flight is not None else {}
        speculative = any(item.drafts for item in batch) if not is_prefill else False
        drafts, spans = (DraftBatch([], []), []) if speculative else (None, None)

        def add(s: Sequence, q: int, position: int) -> None:
            """A sample row of sequence `s` drawing from query row `q`, for its token at `position`."""
            nonlocal processing
            p = s.params
            if p.output_logits:
                logits_rows.append(len(rows))
            if p.needs_sampler_extras:
                processing = self._sampler_extras(s, len(rows), processing, logprob_rows, num_top)
            if p.structured_outputs is not None:
                mask_rows.append(len(rows))
                masked.append(s)
            rows.append(q)
            sampled.append(s)
            temps.append(p.temperature)
            top_ks.append(p.top_k)
            top_ps.append(p.top_p)
            min_ps.append(p.min_p)
            seeds.append(p.seed)
            positions.append(position)

        for item in batch:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                first = max(start, len(seq.prompt_logprobs) - 1)  # position j scores prompt token j + 1
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    plp_at.extend(range(len(input_ids) + first - start, len(input_ids) + last - start))
                    plp_ids.extend(seq.token_ids[first + 1:last + 1])
                    plp_top = max(plp_top, seq.params.prompt_logprobs)
                    prompt_scored.append((seq, first, last - first))
            if item.drafts:  # speculative: the last token and each draft, as one-token decode rows at
                input_ids.append(seq.token_ids[start])  # consecutive positions (the decode kernels and graphs serve
                input_ids.extend(item.drafts)  # them; each row's context ends at its own position)
                k = len(item.drafts)
                starts.extend(range(start, start + k + 1))
                q_lens.extend([1] * (k + 1))
                tables.extend([seq.block_table] * (k + 1))
                adapter_ids.extend([seq.adapter_id] * (k + 1))
            elif n == 1:  # decode: no slice
                token = seq.token_ids[start]
                if token == PENDING:  # sampled by the step still on the device: read it there
                    prev_at.append(len(input_ids))
                    prev_rows.append(row_of[seq.seq_id])
                input_ids.append(token)
            else:
                input_ids.extend(seq.token_ids[start:start + n])
            if not item.drafts:
                starts.append(start)
                q_lens.append(n)
                tables.append(seq.block_table)
                adapter_ids.append(seq.adapter_id)
            if item.samples:
                q = len(starts) - 1 - len(item.drafts)  # its (first) query row
                if item.drafts:  # k drafts: k + 1 rows, row j checking draft j (the last one: the bonus row)
                    spans.append((seq, len(rows), len(item.drafts)))
                    for j, draft in enumerate(item.drafts):
                        drafts.rows.append(len(rows))
                        drafts.tokens.append(draft)
                        add(seq, q + j, len(seq) + j)
                    add(seq, q + len(item.drafts), len(seq) + len(item.drafts))
                    continue
                for s in (seq, *item.forks) if item.forks else (seq,):  # n > 1: every sample draws from row q
                    if spans is not None:
                        spans.append((s, len(rows), 0))
                    add(s, q, len(s))
        sampling = SamplingBatch(temps, top_ks, top_ps, min_ps, seeds, positions, processing, logprob_rows, num_top)
        if masked:  # overlapped: the masks follow the launch, once the grammars know every token
            sampling.mask_rows, sampling.mask_later = mask_rows, self.masks_later
            if not sampling.mask_later:
                sampling.bitmask = self.structured.masks(masked)
        blocks = self.blocks
        step = StepBatch(is_prefill, input_ids, starts, q_lens, tables, rows, sampling, logits_rows, adapter_ids,
                         new_blocks=blocks.take_new_blocks(), from_previous_at=prev_at, from_previous_rows=prev_rows,
                         block_copies=blocks.take_copies(),
                         prompt_logprobs=PromptLogprobsBatch(plp_at, plp_ids, plp_top) if plp_at else None)
        if batch and batch[0].seq.group_tables:  # a hybrid model's KV groups 1.. (engine/hybrid_blocks.py)
            step.group_block_tables = [list(g) for g in zip(*(item.seq.group_tables for item in batch))]
        step.drafts = drafts
        return Launched(batch, step, sampled, prompt_scored, {}, masked or None, spans)

    def _sampler_extras(self, seq: Sequence, row: int, processing: LogitsProcessingBatch | None,
                        logprob_rows: list[int], num_top: list[int]) -> LogitsProcessingBatch | None:
        """Sample row `row` (of `seq`) has penalties, a bias or logprobs: add them to the step's sampling data.

        A penalized sequence gets its token-count slot, filled from its tokens, the first time it samples."""
        p = seq.params
        if p.processes_logits:
            if processing is None:
                processing = LogitsProcessingBatch()
            if p.penalized and seq.penalty_slot is None:
                seq.penalty_slot = self.penalty_slots.take()
                processing.inits.append(SlotInit(seq.penalty_slot, seq.token_ids[:seq.num_prompt_tokens],
                                                 seq.completion_token_ids))
            add_sample_row(processing, row, p, seq.penalty_slot)
        if p.logprobs is not None:
            logprob_rows.append(row)
            num_top.append(p.logprobs)
        return processing


def _add_prompt_logprobs(scored: list[tuple[Sequence, int, int]], step: StepBatch, tensors: LogprobsTensors) -> None:
    """Hand each sequence the logprobs of the prompt positions the step scored for it, in order; a position
    it already has (scored again after a preemption) is not added twice."""
    scored_ids, top = step.prompt_logprobs.token_ids, step.prompt_logprobs.top
    everything = token_logprobs(tensors, scored_ids, [top] * len(scored_ids))
    at = 0
    for seq, first, count in scored:
        k = seq.params.prompt_logprobs
        for j, lp in enumerate(everything[at:at + count], first):
            if len(seq.prompt_logprobs) == j + 1:
                lp.top = lp.top[:k]
                seq.prompt_logprobs.append(lp)
        at += count
