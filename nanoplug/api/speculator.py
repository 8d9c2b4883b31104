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
from typing import Any, Callable, ClassVar, Protocol

from nanoplug.api.interfaces import Plugin


class DraftModel(Protocol):
    """A smaller checkpoint the engine runs for a speculator: its own model plugin and KV cache (prefix caching
    on, so each proposal recomputes only the tokens past its cached blocks), on the target's device."""

    def greedy(self, token_ids: list[list[int]], num_tokens: list[int]) -> list[list[int]]:
        """The next `num_tokens[i]` greedy tokens after `token_ids[i]`, for every i in one batch."""


@dataclass(frozen=True)
class SpeculatorSpec:
    """What a speculator is built with: the most drafts per sequence and step, its own options
    (`EngineConfig.speculator_options`, e.g. {"prompt_lookup_max": 4} for ngram), and the engine's loader of draft
    checkpoints: `load_draft_model(folder, options)` (options: num_kv_blocks, attention), which refuses one whose
    vocabulary is not the target's."""

    num_speculative_tokens: int
    options: dict[str, Any]
    load_draft_model: Callable[[str, dict[str, Any]], DraftModel] | None = None


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
