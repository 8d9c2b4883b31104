"""The engine core stepping in a thread of the server's own process (`nanoplug serve --single-process`).

The default is the engine in a process of its own (engine_process.py, which says why). This layout
saves a process and a socket hop and suits a small machine or debugging; its cost is that the HTTP
front end and the engine's host-side work take turns on one GIL. A whole step's updates cross to
the event loop in one `call_soon_threadsafe`, and each stream merges what piled up into one event.

Threads: the engine's `Driver` (engine/driver.py, the same loop owner as `LLM`'s) is the only caller
of `step()`; handlers submit and abort through it and wait on their `RequestStream`s. Request preparation (tokenizing, the chat
template) runs in a one-thread pool, so a long prompt never stalls the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from nanoplug.config import EngineConfig
from nanoplug.engine.driver import Driver
from nanoplug.engine.engine_core import EngineCore
from nanoplug.server.errors import APIError
from nanoplug.server.prepare import PromptChoices, prepare_all
from nanoplug.server.render import token_texts
from nanoplug.server.streams import RequestStream, Streams

log = logging.getLogger("nanoplug.server")


class EngineLoop:
    """One EngineCore in this process, stepped by a dedicated thread."""

    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.config = self.core.config
        self.max_model_len, self.max_num_seqs = self.config.max_model_len, self.config.max_num_seqs
        self.vocab_size = self.core.facts.vocab_size
        self.max_lora = self.core.max_loras  # per-request adapter slots
        self.streams = Streams()
        self.tokenizer = self.core.tokenizer
        self.token_text = token_texts(self.tokenizer)  # for logprobs
        self.tool_call_format = self.core.tool_call_format  # how its model writes tool calls (server/tools.py)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver = Driver(self.core, on_failure=self._on_failure, stop_on_failure=True)
        self.on_death = lambda reason: None  # the app's: restart or exit (app.py)
        self._prepare = ThreadPoolExecutor(1, thread_name_prefix="nanoplug-prepare")

    @property
    def stats(self):
        return self._driver.stats

    @property
    def failure(self) -> str | None:
        exc = self._driver.failure
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def submit(self, items: list[PromptChoices], fill_context: bool = False,
                     want_prompt_ids: bool = False) -> list[RequestStream]:
        """Validate and queue every choice of every prompt; their updates arrive on the returned streams,
        which share one ready event (see streams.read)."""
        self._check_alive()
        requests = await asyncio.get_running_loop().run_in_executor(
            self._prepare, prepare_all, self.core, items, fill_context)
        self._check_alive()
        ready = asyncio.Event()
        streams = [self.streams.register(request.request_id, ready) for request in requests]
        if want_prompt_ids:
            for stream, request in zip(streams, requests):
                stream.prompt_token_ids = list(request.prompt_token_ids)
        try:
            self._driver.submit(requests, self)
        except BaseException:
            for request in requests:
                self.streams.forget(request.request_id)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """The engine frees the request's blocks at its next step and reports it finished."""
        if request_id in self.streams.open:
            self._driver.abort(request_id)

    async def load_adapter(self, name: str, path: str) -> None:
        """Between two steps (the driver's wheel), beside the event loop; raises the engine's AdapterError."""
        await asyncio.get_running_loop().run_in_executor(self._prepare, self._driver.between_steps,
                                                         self.core.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._prepare, self._driver.between_steps,
                                                         self.core.unload_adapter, name)

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise APIError(503, f"the engine stopped after an error: {self.failure}; restart the server",
                           type="server_error", code="engine_dead")

    # the driver's Sink (its thread -> the loop): one call per step, whatever the number of requests in it
    def deliver(self, updates: list) -> None:
        self._loop.call_soon_threadsafe(self.streams.deliver, updates)

    def fail(self, error: BaseException) -> None:
        pass  # every stream is failed by _on_failure below, which follows

    def _on_failure(self, exc: BaseException) -> None:
        log.error("engine step failed; every open request ends with an error", exc_info=exc)
        error = APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type="server_error",
                         code="engine_error")
        self._loop.call_soon_threadsafe(self._died, error)

    def _died(self, error: APIError) -> None:
        self.streams.fail_all(error)
        self.on_death(self.failure)

    async def restart(self) -> None:
        """After a step failed: a new engine core (the model loaded again), serving once it is up."""
        old = self.core
        self._driver.stop()
        await asyncio.get_running_loop().run_in_executor(None, old.close)
        self.core = await asyncio.get_running_loop().run_in_executor(None, EngineCore, self.config)
        self._driver = Driver(self.core, on_failure=self._on_failure, stop_on_failure=True)

    def stop(self) -> None:
        """Stop stepping and release the engine (idempotent)."""
        self._driver.stop()
        self._prepare.shutdown(wait=False, cancel_futures=True)
        if self.core is not None:
            self.core.close()
            self.core = None
