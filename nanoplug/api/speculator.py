"""The speculator kind: a proposer of draft tokens that the target model verifies in one forward.

A speculator is chosen per engine by name (`EngineConfig(speculator="ngram", num_speculative_tokens=k)`),
resolved once at start-up like any plugin, and asked each decode step for up to `k` draft tokens per sequence
(the engine's adaptive policy picks `k`, 0 turning speculation off for that step). The target model then
scores the last token and every draft in one step; the worker's rejection sampler keeps the longest accepted
prefix plus one token of its own, so the output follows the target's distribution exactly (greedy: token for
token) whatever the drafts were (vLLM v1's semantics; a speculator only changes speed).

Drafts are deterministic proposals (a proposer's argmax, or a lookup): the rejection sampler treats each as a
one-hot draft distribution, as vLLM's does for n-gram and EAGLE proposers.

A speculator over the target's hidden states (EAGLE) subclasses `HiddenStateSpeculator`: at start-up it asks the
worker to keep the hidden states of some layers (`SpeculatorSpec.hidden_states(layer_ids)`, which hands it a
`HiddenStateSource`: the target's device, dtype, sizes, KV-cache geometry and embedding); after every step the
engine hands it that step's rows (`observe(HiddenStep)`: the hidden states stay on the device, never copied to the
host, with each row's next token once the engine knows it), and at a speculative step it proposes from what it
observed (`propose_hidden`). Other speculators pay nothing for this: the worker keeps no hidden state for them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

from nanoplug.api.interfaces import Plugin

if TYPE_CHECKING:
    import torch


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
    facts: Any = None  # the target's ModelFacts (layers, sizes, vocabulary)
    hidden_states: "Callable[[list[int]], HiddenStateSource] | None" = None
    """`hidden_states(layer_ids)`: the worker keeps, each step, the hidden states of the rows it computed at these
    layers (id i: the residual stream entering layer i, so 0 is the embeddings and num_layers the last layer's
    output before the final norm; vLLM's and the speculators package's numbering) and returns the target's side.
    None where the worker cannot (it runs in other processes: tensor parallelism)."""


class Speculator(Plugin, ABC):
    """Proposes draft tokens for running sequences, on the host, from their tokens so far (prompt and output)."""

    options: ClassVar[frozenset[str]] = frozenset()
    """The option names this speculator takes; another is refused at start-up, naming these."""

    kv_layers: ClassVar[int] = 0
    """Layers of K/V in the target's block geometry this speculator keeps on the device (an EAGLE-3 head: 1): the
    worker sizes its cache leaving room for them, so the speculator's cache fits where the target's does."""

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


@dataclass
class HiddenStateSource:
    """The target a hidden-state speculator runs beside, in the worker's process: where and how it computes, and
    the geometry of the target's paged KV cache, whose slots (block * block_size + offset) a head may mirror with
    a cache of its own, so the engine's block tables serve both (a block freed, preempted or shared by prefix
    caching is so for the head too)."""

    device: torch.device
    dtype: torch.dtype
    num_layers: int
    hidden_size: int
    vocab_size: int
    block_size: int
    num_blocks: int  # blocks the engine hands out, plus one scratch block past them
    max_model_len: int
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> the target's input embeddings


@dataclass
class HiddenStep:
    """One step's rows, handed to a hidden-state speculator once the engine applied the step's tokens.

    Rows are the step's query rows in order (a prefill chunk: one per token; a verification: the last token and each
    draft). `groups`: per sequence, (seq_id, start, first row, rows, valid rows): its rows are consecutive, at
    consecutive positions from `start`, and the first `valid` of them have a known next token (a prefill chunk: every
    row; a verification: the accepted drafts' rows and the row before them); `next_ids[r]` is the token at row r's position + 1 (0 where
    not valid: a rejected draft's row, whose slot is written again later). `block_tables`: per group, the sequence's
    block table at the step."""

    hidden: torch.Tensor  # [rows, len(layer_ids) * hidden_size] on the target's device, in its dtype
    positions: torch.Tensor  # [rows] int64, on the device
    slots: torch.Tensor  # [rows] int64: each row's slot in the target's KV cache, on the device
    next_ids: list[int]
    groups: list[tuple[int, int, int, int, int]]
    block_tables: list[list[int]]
    block_copies: list[tuple[int, int]] = ()  # (from, to) KV blocks the target copied after the step (n > 1 forks)


class HiddenStateSpeculator(Speculator):
    """A speculator that proposes from the target's hidden states (EAGLE): `__init__` calls
    `spec.hidden_states(layer_ids)`; the engine calls `observe` after every step and `propose_hidden` at
    speculative steps, and `release` for sequences that ended."""

    @abstractmethod
    def observe(self, step: HiddenStep) -> None:
        """Take a step's rows (its hidden states on the device): fill what later proposals need."""

    @abstractmethod
    def propose_hidden(self, seq_ids: list[int], lengths: list[int], block_tables: list[list[int]],
                       num_drafts: list[int]) -> list[list[int]]:
        """Up to `num_drafts[i]` drafts for sequence `seq_ids[i]` of `lengths[i]` tokens (all known; its last one is
        this step's input, not computed yet); none where it has not observed the tokens before that one."""

    def release(self, seq_ids: list[int]) -> None:
        """These sequences ended (finished or aborted): drop what is kept for them."""

    def propose(self, token_ids: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
        raise TypeError(f"{type(self).__name__} proposes from hidden states: the engine calls propose_hidden")
