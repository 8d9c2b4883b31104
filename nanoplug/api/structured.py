"""Constrained decoding (structured outputs): the constraint a request carries, the contract of a backend
that compiles it against the tokenizer, and the per-sequence matcher that says which tokens may come next.

A backend is a plugin of kind `structured_output`. The engine builds one per engine (lazily, at the
first constrained request: a tokenizer's vocabulary is read once), compiles each new constraint once
(cached by `Constraint.key`), and keeps one matcher per sequence on the engine side, advanced by the
tokens the sampler picked. The masks cross to the worker as a packed bitmask (`pack`: 32 tokens per
int32, bit j of word w allows token 32 w + j, as xgrammar and llguidance both lay them out).
"""
from __future__ import annotations

import functools
import hashlib
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from nanoplug.api.errors import RequestError
from nanoplug.api.interfaces import Plugin

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark", "structural_tag")
"""json: a JSON schema (text); json_object: any JSON object; regex; choice: a JSON list of strings;
grammar: EBNF/GBNF; lark: a Lark grammar; structural_tag: JSON {"triggers": [...], "structures": [{"begin",
"schema", "end"}]}, free text until a trigger, then one of the structures (its schema between begin and end)."""


class ConstraintError(RequestError):
    """A constraint the backend cannot compile: the message names the feature or the syntax error."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint as plain text (so equal constraints hash equal, whatever dict order)."""

    kind: str
    text: str

    @property
    def key(self) -> str:
        """The compiled-grammar cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()


class GrammarMatcher(ABC):
    """One sequence's place in a compiled grammar."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it (the matcher is then stuck)."""

    @abstractmethod
    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, words] bitmask (once `terminated`: any
        row that allows at least the stop tokens; the engine never samples past the end)."""

    @property
    @abstractmethod
    def terminated(self) -> bool:
        """The grammar is complete and accepted its end (a stop token, or nothing may follow)."""


class StructuredOutputBackend(Plugin, ABC):
    """Compiles constraints for one tokenizer and makes matchers of them.

    `tokenizer`: the engine's Hugging Face tokenizer; `vocab_size`: the width of the logits (may exceed
    the tokenizer's: the extra ids are never allowed); `stop_token_ids`: the tokens that end a sequence
    (allowed once the grammar is complete)."""

    kinds: ClassVar[tuple[str, ...]] = CONSTRAINT_KINDS
    """The constraint kinds this backend compiles; another kind is refused with the list."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)

    @abstractmethod
    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar; raise ConstraintError naming what it cannot compile."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    def fill_masks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        """A step's masks at once: `matchers[i]` (this backend's) fills row `rows[i]` of `bitmask`. One call a
        step, so a backend may fill the rows on several threads (the engine waits on it between a step's forward
        and its sampling); by default, one row after another. No matcher given is `terminated`: the engine writes
        the rows of ended grammars itself, without asking each matcher."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_mask(bitmask, row)

    def mask_filler(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> Callable[[], None]:
        """`fill_masks` in two halves: what needs Python's lock done now, on the engine's thread, and the rest
        returned, for the engine to run on its mask thread while its own thread goes on with the step loop's
        Python. The returned call should be one call into native code that releases the lock: Python work in it
        would wait for the step loop's thread at every turn. By default, all of `fill_masks`."""
        return functools.partial(self.fill_masks, matchers, bitmask, rows)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: Any, vocab_size: int) -> Any:
    """int32 [rows, words] (a torch tensor) -> bool [rows, vocab_size], True where a token is allowed (ids past
    the bitmask's, e.g. padding of the logits, never are). On the host numpy's unpackbits does it in one native
    pass (little-endian words: bit j of word w is bit j % 8 of byte 4 w + j // 8)."""
    import torch

    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        bytes_ = bitmask.contiguous().numpy().view(np.uint8)
        bits = torch.from_numpy(np.unpackbits(bytes_, axis=1, count=min(vocab_size, bytes_.shape[1] * 8),
                                              bitorder="little").view(np.bool_))
    else:
        bits = _unpack_by_shifts(bitmask)
    if bits.shape[1] < vocab_size:
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
    return bits[:, :vocab_size]


def _unpack_by_shifts(bitmask: Any) -> Any:
    """`unpack_bitmask` on any device: bool [rows, 32 words]."""
    import torch

    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
