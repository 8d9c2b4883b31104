"""One request as the scheduler runs it: its tokens, how many are computed, and its KV blocks.

The scheduler is the one writer of a sequence's progress (its tokens, `num_computed_tokens`, status);
the block manager writes its block table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count
from nanoplug.core.config import SamplingParams


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
    finish_reason: str | None = None
    adapter_id: int = 0
    num_pending: int = 0  # trailing PENDING placeholders in token_ids

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

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
