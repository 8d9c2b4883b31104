"""TEMPORARY: the pinned EngineCore API (SPEC.md, `nanoplug/core/engine_core.py`) over today's `LLM`.

The server is written against the engine core of the SDK/seams redesign, which is not merged yet.
This adapter implements exactly that API with the current engine's internals (scheduler.add, step,
_check_finish, abort) so the server runs end to end now. Delete this file once `main` has
`nanoplug/core/engine_core.py`; `nanoplug/server/core.py` then imports the real one.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Any

from nanoplug.core.config import EngineConfig, SamplingParams
from nanoplug.core.detokenizer import IncrementalDetokenizer
from nanoplug.core.engine import LLM
from nanoplug.core.errors import RequestError
from nanoplug.core.registry import Registry
from nanoplug.core.sequence import Sequence, Status

_ids = count()


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass
class RequestUpdate:
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[Any] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prompt_tokens_total: int
    generated_tokens_total: int


class EngineCore:
    """TEMPORARY adapter; see the module docstring."""

    def __init__(self, config: EngineConfig, registry: Registry | None = None):
        options = config.model_dump(exclude={"model"}, exclude_unset=True)  # defaults stay defaults (max_model_len)
        self._llm = LLM(config.model, registry, **options)
        self._llm.overlap = False  # one step in, its tokens out: what EngineCore.step promises
        self.config, self.facts = self._llm.config, self._llm.facts
        self.tokenizer, self.eos_token_ids = self._llm.tokenizer, self._llm.eos_token_ids
        self._lock = threading.Lock()
        self._inbox: deque[EngineRequest] = deque()
        self._aborts: deque[str] = deque()
        self._live: dict[str, tuple[Sequence, list[int]]] = {}  # id -> (sequence, [tokens sent])
        self._prompt_tokens = self._generated_tokens = 0

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> EngineRequest:
        (seq,) = self._llm._make_sequences([prompt], params)
        return EngineRequest(request_id or f"req-{next(_ids)}", seq.token_ids, seq.params, seq.prompt)

    def add_request(self, request: EngineRequest) -> None:
        with self._lock:
            self._inbox.append(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._inbox or self._aborts or self._llm.scheduler.has_work())

    def step(self) -> list[RequestUpdate]:
        with self._lock:
            inbox, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = list(self._aborts), deque()
        llm = self._llm
        for req in inbox:
            p = req.params
            seq = Sequence(list(req.prompt_token_ids), p, adapter_id=llm.request_adapter_ids.get(p.adapter, 0))
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, p.stop)
            self._live[req.request_id] = (seq, [0])
            self._prompt_tokens += seq.num_prompt_tokens
            llm.scheduler.add(seq)
        updates = []
        for rid in aborts:
            entry = self._live.pop(rid, None)
            if entry is None:
                continue  # finished already
            seq = entry[0]
            llm.scheduler.abort(seq)
            seq.finish_reason = "abort"
            updates.append(RequestUpdate(rid, [], "", True, "abort", seq.num_prompt_tokens, seq.num_cached_tokens))
        if not llm.scheduler.has_work():
            return updates
        llm.step()
        for rid, (seq, sent) in list(self._live.items()):
            tokens = seq.completion_token_ids[sent[0]:]
            finished = seq.status is Status.FINISHED
            if not tokens and not finished:
                continue
            sent[0] += len(tokens)
            self._generated_tokens += len(tokens)
            updates.append(RequestUpdate(rid, tokens, seq.detok.take(final=finished), finished, seq.finish_reason,
                                         seq.num_prompt_tokens, seq.num_cached_tokens))
            if finished:
                del self._live[rid]
        return updates

    def stats(self) -> EngineStats:
        s = self._llm.scheduler
        return EngineStats(len(s.running), len(s.waiting), s.blocks.num_blocks - s.blocks.num_free_blocks,
                           s.blocks.num_blocks, s.num_preemptions, self._prompt_tokens, self._generated_tokens)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        return self._llm.chat_prompt_ids(messages)

    def close(self) -> None:
        self._llm.close()


__all__ = ["EngineCore", "EngineRequest", "RequestUpdate", "EngineStats", "RequestError"]
