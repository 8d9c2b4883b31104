"""Structured output `xgrammar`: MLC's grammar engine (JSON schema, regex, EBNF, Lark, structural tags), masks
filled on the host."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np

from nanoplug.api import Constraint, ConstraintError, GrammarMatcher, StructuredOutputBackend, Target

JSON_SEPARATORS = (", ", ": ")  # one space after each, no free whitespace: llguidance is set alike (same tokens)
_STDERR_LOCK = threading.Lock()
BATCH_FROM = 4  # rows from which a step's masks are filled by the batch matcher, on several threads


@contextmanager
def _warnings_of_cpp(found: list[str]):
    """Collect what xgrammar's C++ prints on stderr while compiling: it warns (and goes on) where it approximates a
    schema (oneOf as anyOf, multipleOf on numbers ignored, allOf partly). Other lines are written back."""
    with _STDERR_LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines():
                if "Warning:" in line:
                    found.append(line.split("Warning:", 1)[1].strip())
                else:
                    print(line, file=sys.stderr)


class _Matcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self.m = matcher

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        if self.m.is_terminated():  # it accepted a stop token: the row runs ahead of a finished sequence
            bitmask[row] = -1
        else:
            self.m.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()


class XGrammarBackend(StructuredOutputBackend):
    description = "xgrammar: JSON schema, regex, choice, EBNF/GBNF, Lark and structural tags; CPU masks"
    priority = 20

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        return [] if importlib.util.find_spec("xgrammar") else ["xgrammar is not installed; pip install xgrammar"]

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=self.stop_token_ids)
        # the engine caches compiled grammars itself (one owner), so xgrammar's own cache stays off
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batcher = None  # xgrammar's BatchGrammarMatcher, made at the first step with several rows

    def compile(self, constraint: Constraint) -> Any:
        kind, text, c = constraint.kind, constraint.text, self.compiler
        try:
            if kind == "json":
                return self._json(text)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                                  for s in json.loads(text)))
            if kind == "grammar":
                return c.compile_grammar(text)
            if kind == "lark":
                return c.compile_lark(text)
            if kind == "structural_tag":
                return c.compile_structural_tag(self._triggered_tags(json.loads(text)))
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the feature or syntax error
            raise ConstraintError(f"xgrammar cannot compile this {kind} constraint: {_first_line(exc)}") from None
        raise ConstraintError(f"xgrammar compiles {', '.join(self.kinds)}, not {kind!r}")

    def _json(self, text: str) -> Any:
        """A schema xgrammar would only approximate is refused with its own warning: outputs must validate."""
        missing = _required_without_properties(json.loads(text))
        if missing:  # xgrammar drops such a name silently (found by JSONSchemaBench's Github_easy/o28187)
            raise ValueError(f"it cannot generate the required property {missing!r}, which has no schema under "
                             "properties (llguidance may serve it)")
        warnings: list[str] = []
        with _warnings_of_cpp(warnings):
            compiled = self.compiler.compile_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
        if warnings:
            raise ValueError(f"it would only approximate the schema: {warnings[0]} (llguidance may serve it)")
        return compiled

    def _triggered_tags(self, tag: dict) -> str:
        """The engine's {"triggers", "structures", "stop_after_first"} as xgrammar's triggered tags: free text, and
        each structure's JSON between its begin and end once a trigger is written. The JSON is the json kind's
        grammar (the same checks, no free whitespace, the same separators), so llguidance draws the same tokens."""
        tags = []
        for s in tag["structures"]:
            schema = json.dumps(s["schema"])
            missing = _required_without_properties(s["schema"])
            if missing:
                raise ValueError(f"it cannot generate the required property {missing!r}, which has no schema under "
                                 "properties (llguidance may serve it)")
            ebnf = str(self.xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS))
            tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "grammar", "grammar": ebnf}})
        return json.dumps({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": tag["triggers"], "tags": tags,
            "stop_after_first": bool(tag.get("stop_after_first"))}})

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return _Matcher(self.xgr.GrammarMatcher(compiled))

    def fill_masks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        self.mask_filler(matchers, bitmask, rows)()

    def mask_filler(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> Callable[[], None]:
        """Several rows: one call of xgrammar's batch matcher, which fills them on its own threads without Python's
        lock (a big batch's masks took the host longer than the step's forward, one row after another). A few rows:
        one after another."""
        if len(matchers) < BATCH_FROM:
            return functools.partial(super().fill_masks, matchers, bitmask, rows)
        if self.batcher is None:
            self.batcher = self.xgr.BatchGrammarMatcher(max_threads="auto")
        return functools.partial(self.batcher.batch_fill_next_token_bitmask, [m.m for m in matchers], bitmask, rows)


def _required_without_properties(schema: Any) -> str | None:
    """A property some object of `schema` requires but does not declare (None: there is none)."""
    if isinstance(schema, list):
        return next((m for m in map(_required_without_properties, schema) if m), None)
    if not isinstance(schema, dict):
        return None
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list) and (isinstance(properties, dict) or "additionalProperties" not in schema):
        declared = properties if isinstance(properties, dict) else {}
        extra = schema.get("additionalProperties", False)
        if extra is False or extra is None:
            missing = next((r for r in required if isinstance(r, str) and r not in declared), None)
            if missing:
                return missing
    return next((m for m in map(_required_without_properties, schema.values()) if m), None)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
