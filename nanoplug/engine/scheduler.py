"""Continuous batching: which sequences run in the next step, and how many of their tokens.

A step is either a prefill step (chunks of prompts, any number of sequences, under
`max_num_batched_tokens`) or a decode step (one token for each running sequence). Prompts are
admitted while KV blocks last; when decode runs out of blocks the newest sequence is preempted and
later recomputed from its tokens, so no request is lost, duplicated or changed.

The scheduler is the one writer of a sequence's progress: how many of its tokens are computed
(`advance`), the tokens it gains (`append_token`, placeholders for tokens still on the device
included), and its status (admission, preemption, `finish`, `abort`). It also forks the other
samples of a request with n > 1 (`_fork`) and hands out the sampler's token-count slots to
penalized sequences (`penalty_slots`, given back at `finish`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanoplug.engine.blocks import BlockManager
from nanoplug.config import EngineConfig
from nanoplug.engine.penalties import PenaltySlots
from nanoplug.engine.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step
    forks: list[Sequence] = field(default_factory=list)  # other samples of its prompt, drawn from its last token's logits
    drafts: list[int] = field(default_factory=list)  # speculative: draft tokens verified after its last token

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its logits give the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.penalty_slots = PenaltySlots()  # the sampler's token-count rows, held by penalized sequences
        self.forked: list[Sequence] = []  # samples forked since the last take_forked()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Scheduled], bool]:
        """The next step's batch and whether it is a prefill step."""
        batch = self._schedule_prefill()
        is_prefill = bool(batch)
        if not is_prefill:  # (a prompt's last token may come in a decode step, after chunks that left one)
            batch = self._schedule_decode()
        for item in batch:
            if item.seq.forks_left and item.samples:
                self._fork(item)
        return batch, is_prefill

    def _fork(self, item: Scheduled) -> None:
        """The step computes the last prompt token of a request with n > 1: its other samples share the
        prompt's blocks and draw their first tokens from the same logits. A sample that finds no room
        (KV blocks, max_num_seqs) waits as a plain prompt instead: it reuses the cached prompt blocks
        and, with a seed, draws the same tokens."""
        parent, n = item.seq, item.seq.params.n
        later = []
        for i in range(n - parent.forks_left, n):
            child = parent.fork(i)
            self.forked.append(child)
            if len(self.running) < self.max_num_seqs and self.blocks.fork(parent, child):
                child.num_computed_tokens = parent.num_prompt_tokens  # computed by the parent's step
                child.status = Status.RUNNING
                self.running.append(child)
                item.forks.append(child)
            else:
                later.append(child)
        self.waiting.extendleft(reversed(later))
        parent.forks_left = 0

    def take_forked(self) -> list[Sequence]:
        """The samples forked since the last call (their outputs need state of their own)."""
        forked, self.forked = self.forked, []
        return forked

    def _schedule_prefill(self) -> list[Scheduled]:
        batch: list[Scheduled] = []
        budget = self.max_num_batched_tokens
        for seq in self.running:  # chunks of prompts already admitted come first
            if budget == 0:
                return batch
            if seq.is_prefilling:
                self.blocks.release_passed(seq)
                n = min(seq.num_uncomputed_tokens, budget)
                batch.append(Scheduled(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            seq.num_computed_tokens = self.blocks.allocate(seq)  # prefix-cache hits are computed already
            self.blocks.release_passed(seq)  # hits a sliding window has passed
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.scheduled_at is None:
                seq.scheduled_at = time.monotonic()
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.append(Scheduled(seq, n))
            budget -= n
        return batch

    def _schedule_decode(self) -> list[Scheduled]:
        batch: list[Scheduled] = []
        budget = min(self.max_num_seqs, self.max_num_batched_tokens)
        block_size = self.blocks.block_size
        for seq in list(self.running):
            if len(batch) == budget:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted below while serving an earlier sequence
            if seq.num_pending and self._ends_with_pending(seq):
                continue  # its last token is still on the device: nothing follows it
            self.blocks.release_passed(seq)
            if len(seq.token_ids) <= len(seq.block_table) * block_size:  # fast path: room in its last block
                batch.append(Scheduled(seq, 1))
                continue
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slots(seq)
                batch.append(Scheduled(seq, 1))
        return batch

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """Whether the token on its way is the sequence's last one (it reaches max_tokens or max_model_len)."""
        return (seq.num_completion_tokens + seq.num_pending >= seq.params.max_tokens
                or len(seq) >= self.max_model_len)

    def _preempt(self, seq: Sequence) -> None:
        """Give back the sequence's blocks; it returns to the front of the queue and is recomputed."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, batch: list[Scheduled], pending: bool = False) -> None:
        """The step is launched: its tokens count as computed for scheduling the next one. `pending`
        (overlapped steps): each sequence it samples gets a placeholder for the token on its way, so
        the next step can be scheduled before that token arrives (`append_token` fills it in).

        Full blocks are registered for prefix caching (`commit`) once the tokens they hold are
        known, which under overlapped steps is a step later."""
        for item in batch:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            if pending and seq.num_computed_tokens == len(seq.token_ids):  # it samples: its next token is on the way
                seq.add_pending()
                for child in item.forks:  # so do the samples forked from it
                    child.add_pending()

    def reserve_drafts(self, item: Scheduled, drafts: list[int]) -> None:
        """Give a decode item the drafts its lookahead slots have room for (KV blocks past its last token,
        taken while free blocks last; never by preempting another sequence)."""
        room = self.blocks.reserve_lookahead(item.seq, len(drafts))
        item.drafts = drafts[:room]

    def settle_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """A speculative step's tokens are appended: the accepted drafts' K/V count as computed; the blocks
        held only for rejected drafts go back (their slots are written again as the sequence grows)."""
        seq.num_computed_tokens += num_accepted
        self.blocks.trim(seq)

    def append_token(self, seq: Sequence, token: int) -> None:
        """A sampled token arrived: it fills the oldest placeholder, or is appended."""
        seq.resolve_pending(token)

    def commit(self, batch: list[Scheduled]) -> None:
        """Register the full blocks of a resolved step's running sequences for prefix caching."""
        for item in batch:
            if item.seq.status is Status.RUNNING:
                self.blocks.commit(item.seq)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq in self.waiting:  # e.g. preempted while its last token was on the device
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.num_computed_tokens = 0
        seq.drop_pending()
        if reason is not None:
            seq.finish_reason = reason
        if seq.penalty_slot is not None:
            self.penalty_slots.give_back(seq.penalty_slot)
            seq.penalty_slot = None

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (its caller went away), giving back its blocks; the first sample of
        a request with n > 1 takes every other sample with it."""
        seq.forks_left = 0
        for s in seq.samples or [seq]:
            if s.status is not Status.FINISHED:
                self.finish(s)
            s.finish_reason = s.finish_reason or "abort"
