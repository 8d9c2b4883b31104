"""The speculator kind: a proposer of draft tokens that the target model verifies in one forward.

A speculator is chosen per engine by name (`EngineConfig(speculator="ngram", num_speculative_tokens=k)`),
resolved once at start-up like any plugin, and asked each decode step for up to `k` draft tokens per sequence
(the engine's adaptive policy picks `k`, 0 turning speculation off for that step). The target model then
scores the last token and every draft in one step; the worker's rejection sampler keeps the longest accepted
prefix plus one token of its own, so the output follows the target's distribution exactly (greedy: token for
token) whatever the drafts were (vLLM v1's semantics; a speculator only changes speed).

Drafts are deterministic proposals (a proposer's argmax, or a lookup): the rejection sampler treats each as a
one-hot draft distribution, as vLLM's does for n-gram and EAGLE proposers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from nanoplug.api.interfaces import Plugin


@dataclass(frozen=True)
class SpeculatorSpec:
    """What a speculator is built with: the most drafts per sequence and step, and its own options
    (`EngineConfig.speculator_options`, e.g. {"prompt_lookup_max": 4} for ngram)."""

    num_speculative_tokens: int
    options: dict[str, Any]


class Speculator(Plugin, ABC):
    """Proposes draft tokens for running sequences, on the host, from their tokens so far (prompt and output)."""

    options: ClassVar[frozenset[str]] = frozenset()
    """The option names this speculator takes; another is refused at start-up, naming these."""

    def __init__(self, spec: SpeculatorSpec):
        unknown = sorted(set(spec.options) - self.options)
        if unknown:
            raise ValueError(f"speculator {type(self).__name__} takes no option {', '.join(map(repr, unknown))}; "
                             f"its options: {', '.join(sorted(self.options)) or 'none'}")
        self.spec = spec

    @abstractmethod
    def propose(self, token_ids: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
        """Up to `num_drafts[i]` draft tokens to follow `token_ids[i]` (a sequence's tokens, prompt then output,
        every one known); fewer, or none, where it has no good guess. Called once per speculative step with
        every sequence of the step, so a proposer can batch its work."""
