"""One request as the engine tracks it: its tokens, how many are computed, and its KV blocks."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count
from typing import Any

from nanoplug.core.config import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = count()


@dataclass(eq=False)
class Sequence:
    """Prompt plus generated tokens. `num_computed_tokens` of them have K/V in the cache."""

    token_ids: list[int]
    params: SamplingParams
    index: int = 0  # position in the caller's list of prompts
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of committed full blocks
    finish_reason: str | None = None
    logits: list[Any] = field(default_factory=list)
    adapter_id: int = 0
    detok: Any = None  # the engine's incremental detokenizer state

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token lacks K/V: the next step is (part of) a prefill."""
        return self.num_uncomputed_tokens > 1
