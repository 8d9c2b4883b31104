"""Incremental detokenization for streaming and stop strings.

Decoding a growing token list one token at a time can split a multi-byte character or a word
piece; like vLLM, decode a short window and emit only text that is complete (no trailing U+FFFD).
"""
from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""  # all complete text of the completion so far
        self.emitted = 0  # characters handed to the caller
        self.stops = stops
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def flush(self) -> None:
        """The request ended: keep even an incomplete character, as a full decode would show it."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)

    def find_stop(self) -> int | None:
        """Index where the first stop string starts in the text, if one appeared."""
        search_from = max(0, self.emitted - self.holdback - 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def take(self, final: bool) -> str:
        """Text not handed out yet; while running, hold back what could still start a stop string."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return delta
