"""One request as the scheduler runs it: its tokens, how many are computed, and its KV blocks.

The scheduler is the one writer of a sequence's progress (its tokens, `num_computed_tokens`, status);
the block manager writes its block table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count
from typing import Any
from nanoplug.config import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = count()
PENDING = -1  # a token sampled by a step still on the device (overlapped steps); replaced when it arrives


@dataclass(eq=False)
class Sequence:
    """Prompt plus generated tokens. `num_computed_tokens` of them have K/V in the cache."""

    token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of committed full blocks
    group_tables: list[list[int]] = field(default_factory=list)  # KV groups 1.. of a hybrid model (hybrid_blocks.py)
    finish_reason: str | None = None
    adapter_id: int = 0
    adapter_load: int = 0  # which load of that adapter slot (a slot reused at run time must not share cached K/V)
    # when it reached the engine (added) and was first scheduled: its queue time, reported once (metrics)
    arrived_at: float = 0.0
    scheduled_at: float | None = None
    num_pending: int = 0  # trailing PENDING placeholders in token_ids
    # n > 1: every sample is a Sequence; the request's first one (root None) forks the others when the
    # last token of its prompt is scheduled, and lists them all in `samples`, itself first
    root: "Sequence | None" = None
    sample_index: int = 0
    forks_left: int = 0  # samples still to fork from this one
    samples: list["Sequence"] = field(default_factory=list)
    penalty_slot: int | None = None  # its row of the sampler's token counts (penalized requests)
    # prompt logprobs, when asked: [None, then those of prompt tokens 1.. as steps score them]. Kept here
    # (not only in the output) because a prompt that still owes some skips the prefix cache
    prompt_logprobs: list[Any] | None = None
    # structured outputs: its grammar matcher (engine/structured.py, made at its first sampled token; each sample
    # of n > 1 its own), whether the grammar refused a token, and whether it ended (accepted a stop token)
    grammar: Any = None
    grammar_failed: bool = False
    grammar_ended: bool = False

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.root is None:
            self.samples = [self]
            self.forks_left = self.params.n - 1
            if self.params.prompt_logprobs is not None:
                self.prompt_logprobs = [None]

    def fork(self, sample_index: int) -> "Sequence":
        """Sample `sample_index` of this request: the prompt alone (no blocks yet), its seed moved on by the
        index as vLLM does, so each sample is reproducible and they differ."""
        params = self.params
        if params.seed is not None:
            params = params.model_copy(update={"seed": params.seed + sample_index})
        child = Sequence(self.token_ids[:self.num_prompt_tokens], params, request_id=self.request_id, root=self,
                         sample_index=sample_index, num_prompt_tokens=self.num_prompt_tokens,
                         adapter_id=self.adapter_id, adapter_load=self.adapter_load)
        self.samples.append(child)
        return child

    @property
    def request_finished(self) -> bool:
        """Every sample of the request this one starts has finished (call on the first sample)."""
        return all(s.status is Status.FINISHED for s in self.samples)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    def add_pending(self) -> None:
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def resolve_pending(self, token: int) -> None:
        """The oldest pending token arrived (or, with none pending, a new token)."""
        if self.num_pending:
            self.token_ids[len(self.token_ids) - self.num_pending] = token
            self.num_pending -= 1
        else:
            self.token_ids.append(token)

    def drop_pending(self) -> None:
        """The sequence ended: tokens still on the way are not part of it."""
        if self.num_pending:
            del self.token_ids[len(self.token_ids) - self.num_pending:]
            self.num_pending = 0

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token lacks K/V: the next step is (part of) a prefill."""
        return self.num_uncomputed_tokens > 1
