"""Continuous batching: which sequences run in the next step, and how many of their tokens.

A step is either a prefill step (chunks of prompts, any number of sequences, under
`max_num_batched_tokens`) or a decode step (one token for each running sequence). Prompts are
admitted while KV blocks last; when decode runs out of blocks the newest sequence is preempted and
later recomputed from its tokens, so no request is lost, duplicated or changed.

The scheduler is the one writer of a sequence's progress: how many of its tokens are computed
(`advance`), the tokens it gains (`append_token`, placeholders for tokens still on the device
included), and its status (admission, preemption, `finish`, `abort`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanoplug.core.blocks import BlockManager
from nanoplug.core.config import EngineConfig
from nanoplug.core.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step

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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Scheduled], bool]:
        """The next step's batch and whether it is a prefill step."""
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Scheduled]:
        batch: list[Scheduled] = []
        budget = self.max_num_batched_tokens
        for seq in self.running:  # chunks of prompts already admitted come first
            if budget == 0:
                return batch
            if seq.is_prefilling:
                n = min(seq.num_uncomputed_tokens, budget)
                batch.append(Scheduled(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            seq.num_computed_tokens = self.blocks.allocate(seq)  # prefix-cache hits are computed already
            self.waiting.popleft()
            seq.status = Status.RUNNING
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
            if pending and seq.num_computed_tokens == len(seq):  # it samples: its next token is on the way
                seq.add_pending()

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

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (its caller went away), giving back its blocks."""
        if seq.status is not Status.FINISHED:
            self.finish(seq)
        seq.finish_reason = seq.finish_reason or "abort"
