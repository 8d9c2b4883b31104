"""Penalties and logit bias on the engine's side: which token-count slot each penalized sequence holds,
and the rows of a step's `LogitsProcessingBatch`. The device side is `nanoplug.worker.logits_processors`."""
from __future__ import annotations

from nanoplug.api import LogitsProcessingBatch
from nanoplug.config import SamplingParams
from nanoplug.errors import RequestError


def add_sample_row(batch: LogitsProcessingBatch, row: int, params: SamplingParams, slot: int | None) -> None:
    """Sample row `row` draws under `params`; `slot` is its token-count slot when it is penalized."""
    if params.penalized:
        assert slot is not None, "a penalized row needs a token-count slot"
        batch.rows.append(row)
        batch.slots.append(slot)
        batch.presence.append(params.presence_penalty)
        batch.frequency.append(params.frequency_penalty)
        batch.repetition.append(params.repetition_penalty)
    if params.logit_bias:
        batch.bias_rows.extend([row] * len(params.logit_bias))
        batch.bias_token_ids.extend(params.logit_bias)
        batch.bias_values.extend(params.logit_bias.values())


class PenaltySlots:
    """The host's record of which token-count slots are free (the device rows are the sampler's).

    The lowest free slot is handed out first, so the device state grows only to the most
    penalized sequences alive at once."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.size = 0

    def take(self) -> int:
        if self.free:
            self.free.sort(reverse=True)
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def in_use(self) -> int:
        return self.size - len(self.free)


def check_token_ids(params: SamplingParams, vocab_size: int, what: str = "the request") -> None:
    """The logit bias names tokens of this model's vocabulary (SamplingParams cannot know its size)."""
    bad = sorted(t for t in params.logit_bias if t >= vocab_size)
    if bad:
        raise RequestError(f"{what} has logit_bias for token id {bad[0]}, outside the vocabulary [0, {vocab_size}); "
                           "use token ids of this model's tokenizer")
