"""Structured output `llguidance`: Microsoft's Earley-based engine (JSON schema, regex, GBNF, Lark and structural
tags), masks filled on the host."""
from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any, Callable

import numpy as np

from nanoplug.api import Constraint, ConstraintError, GrammarMatcher, StructuredOutputBackend, Target

# as the xgrammar backend: ", " and ": " between items, no free whitespace (the same language, the same tokens)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BATCH_FROM = 4  # rows from which a step's masks are filled by the executor, on several threads


class _Matcher(GrammarMatcher):
    def __init__(self, matcher: Any, fill: Any):
        self.m, self.fill = matcher, fill

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        self.fill(self.m, bitmask, row)

    @property
    def terminated(self) -> bool:
        return self.m.is_stopped()


class LLGuidanceBackend(StructuredOutputBackend):
    description = "llguidance: JSON schema, regex, choice, GBNF, Lark and structural tags; CPU masks"
    priority = 10

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        return [] if importlib.util.find_spec("llguidance") else ["llguidance is not installed; pip install llguidance"]

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.fill = llguidance.numpy.fill_next_token_bitmask
        self.fill_par = llguidance.numpy.fill_next_token_bitmask_par
        self.executor = None  # llguidance's thread pool, made at the first step with several rows
        self.tokenizer_ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=self.stop_token_ids or None)

    def compile(self, constraint: Constraint) -> Any:
        kind, text, llg = constraint.kind, constraint.text, self.llg
        try:
            if kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(text)
            elif kind == "choice":
                grammar = llg.grammar_from("choice", json.dumps(json.loads(text)))
            elif kind == "grammar":
                grammar = llg.grammar_from("grammar", text)
            elif kind == "lark":
                grammar = llg.LLMatcher.grammar_from_lark(text)
            elif kind == "structural_tag":
                grammar = llg.LLMatcher.grammar_from_lark(self._struct_tags(json.loads(text)))
            else:
                raise ConstraintError(f"llguidance compiles {', '.join(self.kinds)}, not {kind!r}")
        except ConstraintError:
            raise
        except Exception as exc:
            raise ConstraintError(f"llguidance cannot compile this {kind} constraint: {_first_line(exc)}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer_ll)
        if error:
            raise ConstraintError(f"llguidance cannot compile this {kind} constraint: {_first_line(error)}")
        return grammar

    def _struct_tags(self, tag: dict) -> str:
        """The engine's {"triggers", "structures", "stop_after_first"} as a lazy-trigger Lark grammar (llguidance's
        StructTag.to_grammar, with a start rule allowing one structure at most when `stop_after_first`), each
        structure's JSON written as the json kind writes it. A trigger is text, not a special token."""
        rules, options = [], []
        for i, s in enumerate(tag["structures"]):
            trigger = next(t for t in tag["triggers"] if s["begin"].startswith(t))
            schema = s["schema"] if isinstance(s["schema"], dict) else {}
            body = " ".join(filter(None, (_lark_text(s["begin"][len(trigger):]),
                                          "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}),
                                          _lark_text(s["end"]))))
            rules += [f"tag_{i}_trig[lazy]: TAG_TEXT {_lark_text(trigger)}", f"tag_{i}: tag_{i}_trig {body}"]
            options.append(f"tag_{i}")
        calls = " | ".join(options)
        start = f"start: ({calls}) | tag_end" if tag.get("stop_after_first") else f"start: ({calls})* tag_end"
        return "\n".join(["%llguidance {}", start, "tag_end: TAG_TEXT", r"TAG_TEXT: /(.|\n)*/", *rules]) + "\n"

    def matcher(self, compiled: Any) -> GrammarMatcher:
        m = self.llg.LLMatcher(self.tokenizer_ll, compiled, log_level=0)
        if m.is_error():
            raise ConstraintError(f"llguidance cannot compile this constraint: {_first_line(m.get_error())}")
        return _Matcher(m, self.fill)

    def fill_masks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        self.mask_filler(matchers, bitmask, rows)()

    def mask_filler(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> Callable[[], None]:
        """Several rows: the (matcher, row) pairs made now, and one call of llguidance's executor fills them on its
        own threads without Python's lock. A few rows: one after another."""
        if len(matchers) < BATCH_FROM:
            return functools.partial(super().fill_masks, matchers, bitmask, rows)
        if self.executor is None:
            self.executor = self.llg.LLExecutor()
        return functools.partial(self.fill_par, self.executor, [(m.m, row) for m, row in zip(matchers, rows)],
                                 bitmask)


def _first_line(exc: Any) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def _lark_text(text: str) -> str:
    """A Lark string literal for `text` ("" for none)."""
    return json.dumps(text) if text else ""
