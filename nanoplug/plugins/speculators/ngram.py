"""Speculator `ngram`: prompt lookup over the request's own tokens (prompt and output), on the host.

The last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up earlier in the
sequence; the tokens that followed the most recent occurrence of the longest match are the drafts (vLLM's
`NgramProposer`). The search is numpy over the whole history, one vectorised comparison per n-gram length:
C speed, no Python loop over tokens. Texts that copy from their prompt (summaries, extraction, edits) accept
long runs of drafts.
"""
from __future__ import annotations

import numpy as np

from nanoplug.api import Speculator, SpeculatorSpec


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` of
    `min_n`..`max_n` tokens (empty: no such suffix occurs earlier)."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return tokens[:0]
    # candidates j: an earlier position holding the last token, with a token after it (j < length - 1)
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    best = None
    for o in range(1, min(max_n, length - 1) + 1):  # the match so far is o tokens long, ending at each of `ends`
        if not len(ends):
            break
        if o >= min_n:
            best = ends
        if o == max_n:
            break
        ends = ends[ends >= o]
        ends = ends[tokens[ends - o] == tokens[length - 1 - o]]
    if best is None or not len(best):
        return tokens[:0]
    start = int(best[-1]) + 1  # the most recent occurrence of the longest match
    return tokens[start:start + k]


class NgramSpeculator(Speculator):
    description = "prompt lookup: drafts copied from where the last n tokens occurred before (host, numpy)"
    priority = 10
    options = frozenset({"prompt_lookup_min", "prompt_lookup_max"})

    def __init__(self, spec: SpeculatorSpec):
        super().__init__(spec)
        self.min_n = int(spec.options.get("prompt_lookup_min", 2))
        self.max_n = int(spec.options.get("prompt_lookup_max", 5))
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.min_n} and "
                             f"{self.max_n}; e.g. speculator_options={{'prompt_lookup_min': 2, 'prompt_lookup_max': 5}}")

    def propose(self, token_ids: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
        return [lookup(np.asarray(ids, dtype=np.int64), k, self.min_n, self.max_n).tolist() if k > 0 else []
                for ids, k in zip(token_ids, num_drafts)]
