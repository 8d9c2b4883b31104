"""One request's updates on their way from the engine to its HTTP handler, on the asyncio loop.

The engine side hands a whole step's updates to the loop at once (`Streams.deliver`, one
`call_soon_threadsafe` per step, not per request). A handler that reads slower than the engine steps
finds several updates waiting and takes them as one `Delta`: at high concurrency a stream sends one
SSE event per read, never a backlog of one event per token.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nanoplug.server.errors import APIError


@dataclass
class Delta:
    """What a request gained since the handler's last read (one or more engine updates merged)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None  # when asked: None first, then one entry per prompt token


class RequestStream:
    """The updates of one engine request not yet read by its handler.

    Several streams may share one `ready` event: a response with several choices (n > 1, a list of
    prompts) waits on one event and then takes whatever each of its streams gained."""

    __slots__ = ("request_id", "owner", "arrived", "heard", "first_token_at", "last_token_at", "_pending", "ready", "error",
                 "finished", "done", "num_tokens", "prompt_token_ids")

    def __init__(self, request_id: str, ready: asyncio.Event | None = None, owner: int = 0):
        self.request_id = request_id
        self.owner = owner  # the engine replica serving it (data parallelism; 0 with one engine)
        self.arrived = time.monotonic()
        self.heard = False  # an update of it arrived (its first carries the queue time and cache hits)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._pending: list[Any] = []
        self.ready = ready or asyncio.Event()
        self.error: APIError | None = None
        self.finished = False  # the engine reported its last update
        self.done = False  # the handler took that last update
        self.num_tokens = 0
        self.prompt_token_ids: list[int] | None = None  # filled in when the submitter asked (echo with logprobs)

    def push(self, update: Any) -> None:
        self._pending.append(update)
        self.ready.set()

    def fail(self, error: APIError) -> None:
        """End the stream with an error (shutdown, engine failure); the handler raises it on its next read."""
        self.error = error
        self.ready.set()

    def take(self) -> Delta | None:
        """Everything that arrived since the last take, merged into one Delta (None: nothing new)."""
        if self.error is not None and not self.finished:
            raise self.error
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        last = pending[-1]
        delta = Delta(finished=last.finished, finish_reason=last.finish_reason,
                      num_prompt_tokens=last.num_prompt_tokens, num_cached_tokens=last.num_cached_tokens)
        texts = []
        for u in pending:
            delta.token_ids += u.token_ids
            texts.append(u.text)
            if u.logprobs is not None:
                delta.logprobs = (delta.logprobs or []) + list(u.logprobs)
            if getattr(u, "prompt_logprobs", None) is not None:
                delta.prompt_logprobs = list(u.prompt_logprobs)
        delta.text = "".join(texts)
        self.done = delta.finished
        return delta


async def read(streams: list[RequestStream]):
    """Yield lists of (index, Delta) as the streams gain tokens, until every one is done.

    All `streams` share one ready event (see `Streams.register`)."""
    ready = streams[0].ready
    while True:
        got = []
        for i, stream in enumerate(streams):
            if not stream.done:
                delta = stream.take()
                if delta is not None:
                    got.append((i, delta))
        if got:
            yield got
        elif all(stream.done for stream in streams):
            return
        else:
            ready.clear()
            await ready.wait()


class Streams:
    """The open streams by request id, and the delivery of engine updates to them (loop thread only)."""

    def __init__(self, on_tokens: Callable[[RequestStream, int, float], None] | None = None,
                 on_finish: Callable[[RequestStream, str | None], None] | None = None):
        self.open: dict[str, RequestStream] = {}
        self.load: dict[int, int] = {}  # open streams per owner (engine replica)
        self.on_tokens, self.on_finish = on_tokens, on_finish
        self.on_first: Callable[[RequestStream, Any], None] | None = None  # a stream's first update

    def __len__(self) -> int:
        return len(self.open)

    def register(self, request_id: str, ready: asyncio.Event | None = None, owner: int = 0) -> RequestStream:
        stream = self.open[request_id] = RequestStream(request_id, ready, owner)
        self.load[owner] = self.load.get(owner, 0) + 1
        return stream

    def _closed(self, stream: RequestStream) -> None:
        self.load[stream.owner] -= 1

    def deliver(self, updates: list[Any]) -> None:
        now = time.monotonic()
        for u in updates:
            stream = self.open.get(u.request_id)
            if stream is None:
                continue  # its handler gave up (abort on its way)
            if not stream.heard:
                stream.heard = True
                if self.on_first:
                    self.on_first(stream, u)
            if u.token_ids:
                stream.num_tokens += len(u.token_ids)
                if self.on_tokens:
                    self.on_tokens(stream, len(u.token_ids), now)
                stream.first_token_at = stream.first_token_at or now
                stream.last_token_at = now
            if u.finished:
                stream.finished = True
                del self.open[u.request_id]
                self._closed(stream)
                if self.on_finish:
                    self.on_finish(stream, u.finish_reason)
            stream.push(u)

    def forget(self, request_id: str) -> None:
        stream = self.open.pop(request_id, None)
        if stream is not None:
            self._closed(stream)

    def fail_all(self, error: APIError, owner: int | None = None) -> None:
        """End every open stream (or only those `owner` serves) with `error`."""
        streams = [s for s in self.open.values() if owner is None or s.owner == owner]
        for stream in streams:
            del self.open[stream.request_id]
            self._closed(stream)
            stream.fail(error)
