"""The engine core stepping in a thread of the server's own process (`nanoplug serve --single-process`).

The default is the engine in a process of its own (engine_process.py, which says why). This layout
saves a process and a socket hop and suits a small machine or debugging; its cost is that the HTTP
front end and the engine's host-side work take turns on one GIL. A whole step's updates cross to
the event loop in one `call_soon_threadsafe`, and each stream merges what piled up into one event.

Threads: the Stepper's thread is the only caller of `step()`; handlers call the thread-safe
`add_request`/`abort` and wait on their `RequestStream`s. Request preparation (tokenizing, the chat
template) runs in a one-thread pool, so a long prompt never stalls the event loop.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from nanoplug.config import EngineConfig
from nanoplug.engine.engine_core import EngineCore
from nanoplug.server.errors import APIError
from nanoplug.server.prepare import PromptChoices, prepare_all
from nanoplug.server.render import token_texts
from nanoplug.server.stepper import Stepper
from nanoplug.server.streams import RequestStream, Streams


class EngineLoop:
    """One EngineCore in this process, stepped by a dedicated thread."""

    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.config = self.core.config
        self.max_model_len, self.max_num_seqs = self.config.max_model_len, self.config.max_num_seqs
        self.streams = Streams()
        self.token_text = token_texts(self.core.tokenizer)  # for logprobs
        self.tool_call_format = self.core.tool_call_format  # how its model writes tool calls (server/tools.py)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stepper = Stepper(self.core, self._on_step, self._on_failure)
        self._prepare = ThreadPoolExecutor(1, thread_name_prefix="nanoplug-prepare")

    @property
    def stats(self):
        return self._stepper.stats

    @property
    def failure(self) -> str | None:
        return self._stepper.failure

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stepper.start()

    async def submit(self, items: list[PromptChoices], fill_context: bool = False) -> list[RequestStream]:
        """Validate and queue every choice of every prompt; their updates arrive on the returned streams,
        which share one ready event (see streams.read)."""
        self._check_alive()
        requests = await asyncio.get_running_loop().run_in_executor(
            self._prepare, prepare_all, self.core, items, fill_context)
        self._check_alive()
        ready = asyncio.Event()
        streams = []
        for request in requests:
            streams.append(self.streams.register(request.request_id, ready))
            self.core.add_request(request)
        self._stepper.wake()
        return streams

    def abort(self, request_id: str) -> None:
        """The engine frees the request's blocks at its next step and reports it finished."""
        if request_id in self.streams.open:
            self.core.abort(request_id)
            self._stepper.wake()

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise APIError(503, f"the engine stopped after an error: {self.failure}; restart the server",
                           type="server_error", code="engine_dead")

    # engine thread -> loop: one call per step, whatever the number of requests in it
    def _on_step(self, updates: list, stats) -> None:
        if updates:
            self._loop.call_soon_threadsafe(self.streams.deliver, updates)

    def _on_failure(self, reason: str) -> None:
        error = APIError(500, f"the engine failed: {reason}", type="server_error", code="engine_error")
        self._loop.call_soon_threadsafe(self.streams.fail_all, error)

    def stop(self) -> None:
        """Stop stepping and release the engine (idempotent)."""
        self._stepper.stop()
        self._prepare.shutdown(wait=False, cancel_futures=True)
        if self.core is not None:
            self.core.close()
            self.core = None
