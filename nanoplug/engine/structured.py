"""Structured outputs on the engine side: the backend of this engine, its compiled grammars (cached by the
constraint's hash), and each constrained sequence's matcher, advanced by the tokens it is given.

The backend plugin is resolved at start-up (asked, chosen, why) but built at the first constrained request,
so an engine that never sees one never reads its vocabulary into a grammar library. Compiling happens in
`make_request` (the caller's thread, before anything is queued): a bad constraint is that caller's
RequestError, and the step loop only ever fills masks from grammars compiled already.

An overlapped engine fills a step's masks on a thread of their own (`begin`/`end`) while its own thread hands
the last step's tokens out and schedules and builds the next one: both libraries fill without the GIL, so the
fill leaves the step's critical path whenever it is shorter than that work.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from nanoplug.api import Constraint, GrammarMatcher, bitmask_words
from nanoplug.api.errors import PluginUnavailableError
from nanoplug.api.step import host_array
from nanoplug.config import SamplingParams
from nanoplug.engine.registry import Registry, Resolution
from nanoplug.engine.sequence import Sequence
from nanoplug.engine.switching import fast_switching as _fast_switching
from nanoplug.errors import RequestError

log = logging.getLogger("nanoplug")
CACHE_SIZE = 512  # compiled grammars kept per engine (least recently used dropped first)


class StructuredOutputs:
    """One engine's constrained decoding: backend, grammar cache, and the matchers of its sequences."""

    def __init__(self, resolution: Resolution | None, why_none: str, tokenizer: Any, vocab_size: int,
                 stop_token_ids: set[int], device: torch.device | None = None):
        self.resolution, self.why_none = resolution, why_none
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, frozenset(stop_token_ids)
        self.words = bitmask_words(vocab_size)
        self.device = device or torch.device("cpu")
        # the steps' bitmasks, written where the device's copy reads them (pinned on CUDA), two used in turn: a
        # step's masks are filled once the step before it is collected, so the copy of the last but one has run
        self.bitmasks: list[np.ndarray | None] = [None, None]
        self.turn = 0
        self.backend = None
        self.cache: OrderedDict[str, Any] = OrderedDict()
        self.lock = threading.Lock()  # make_request compiles on callers' threads
        self.compile_seconds: dict[str, float] = {}  # the first compile of each key, for benchmarks
        self.pool: ThreadPoolExecutor | None = None  # the mask thread (begin/end), made at the first use
        self.job: tuple[Future, np.ndarray] | None = None  # the fill on the mask thread, and its bitmask

    @classmethod
    def resolve(cls, registry: Registry, asked: str, target: Any) -> tuple[Resolution | None, str]:
        """The backend for this engine; with "auto" and none available, None and why (requests then hear it)."""
        try:
            return registry.resolve("structured_output", asked, target), ""
        except PluginUnavailableError as exc:
            if asked != "auto":
                raise
            return None, str(exc)

    @property
    def name(self) -> str | None:
        return self.resolution.name if self.resolution is not None else None

    def _backend(self) -> Any:
        if self.backend is None:
            if self.resolution is None:
                raise RequestError(f"this request has a structured-output constraint, but {self.why_none}; "
                                   "pip install xgrammar or llguidance")
            started = time.perf_counter()
            self.backend = self.resolution.cls(self.tokenizer, self.vocab_size, sorted(self.stop_token_ids))
            log.info("structured output: %s ready in %.3f s", self.resolution.name, time.perf_counter() - started)
        return self.backend

    def compiled(self, constraint: Constraint) -> Any:
        """The compiled grammar of `constraint` (compiled now if new); ConstraintError when it cannot be."""
        key = constraint.key
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            backend = self._backend()
            started = time.perf_counter()
            grammar = backend.compile(constraint)  # raises ConstraintError (a RequestError) naming the problem
            self.compile_seconds.setdefault(key, time.perf_counter() - started)
            self.cache[key] = grammar
            if len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
            return grammar

    def check(self, params: SamplingParams, where: str) -> None:
        """Compile the request's constraint now (before it is queued), so a bad one is the caller's error."""
        if self.tokenizer is None:
            raise RequestError(f"{where} has a structured-output constraint, but this LLM has no tokenizer "
                               "(skip_tokenizer_init=True) to build grammars over")
        try:
            self.compiled(params.structured_outputs.constraint)
        except RequestError as exc:
            raise type(exc)(f"{where}: {exc}") from None

    # ------------------------------------------------------------------------------ per step
    def _matcher(self, seq: Sequence) -> GrammarMatcher:
        if seq.grammar is None:
            seq.grammar = self._backend().matcher(self.compiled(seq.params.structured_outputs.constraint))
        return seq.grammar

    def masks(self, seqs: list[Sequence]) -> np.ndarray:
        """The packed bitmask of each sequence's allowed next tokens, int32 [len(seqs), words]. A grammar that is
        complete allows the stop tokens (a row of an ended sequence runs ahead for nothing); one that is stuck
        allows every token."""
        bitmask, fill = self._filler(seqs)
        fill()
        return bitmask

    def begin(self, seqs: list[Sequence]) -> None:
        """Start filling `seqs`' masks on the mask thread; `end` returns them. One fill at a time. What needs
        Python's lock is done here, so the thread's part runs beside this one's Python (the backend's
        `mask_filler`)."""
        assert self.job is None, "end() the fill begun before"
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="nanoplug-masks")
        bitmask, fill = self._filler(seqs)
        _fast_switching.enter()  # the thread takes the lock twice (to start and to end the native call)
        self.job = (self.pool.submit(fill), bitmask)

    def end(self) -> np.ndarray:
        """The masks `begin` started (waiting for them); a failure of the fill is raised here."""
        (job, bitmask), self.job = self.job, None
        try:
            job.result()
            return bitmask
        finally:
            _fast_switching.leave()

    def _filler(self, seqs: list[Sequence]) -> tuple[np.ndarray, Callable[[], None]]:
        """The step's bitmask and the call that fills its rows (a stuck grammar's row is written now)."""
        bitmask = self._bitmask(len(seqs))
        matchers, rows = [], []
        for row, seq in enumerate(seqs):
            matcher = self._matcher(seq)
            if seq.grammar_failed or seq.grammar_ended:  # (an ended one: its row runs ahead for nothing)
                bitmask[row] = -1
            else:
                matchers.append(matcher)
                rows.append(row)
        return bitmask, self._backend().mask_filler(matchers, bitmask, rows)

    def close(self) -> None:
        if self.job is not None:
            self.job[0].cancel()
            self.job = None
            _fast_switching.leave()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def _bitmask(self, rows: int) -> np.ndarray:
        self.turn ^= 1
        buffer = self.bitmasks[self.turn]
        if buffer is None or buffer.shape[0] < rows:
            buffer = self.bitmasks[self.turn] = host_array((max(rows, 8), self.words), torch.int32, self.device)
        return buffer[:rows]

    def accept(self, seq: Sequence, token: int) -> str | None:
        """Advance the sequence's grammar by its new token: "stop" when the grammar has ended on a stop token
        (it finishes even with ignore_eos), "abort" when the grammar refuses the token (never under its own
        mask; logged), else None."""
        return self.accept_many([seq], [token])[0]

    def accept_many(self, seqs: list[Sequence], tokens: list[int]) -> list[str | None]:
        """`accept` for a step's sequences (one token each), in one pass. (Both libraries' batch calls were
        slower than this loop for 64 sequences: xgrammar's converts its answer a call per element, llguidance's
        hands the tokens to threads.)"""
        said: list[str | None] = [None] * len(seqs)
        stops = self.stop_token_ids
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            matcher = self._matcher(seq)
            if seq.grammar_failed:
                continue
            if not matcher.accept(token):
                seq.grammar_failed = True
                log.error("request %s: the grammar refused token %d that was sampled under its mask",
                          seq.request_id, token)
                said[i] = "abort"
            # (the cheap test first: the matcher is asked whether it ended only after a stop token, a call less)
            elif token in stops and matcher.terminated:
                seq.grammar_ended = True
                said[i] = "stop"
        return said
