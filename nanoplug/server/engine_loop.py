"""The engine core stepping in a thread of the server's own process, fed by the asyncio handlers.

Why one process (measured in benchmarks/RESULTS.md, "serve: one process or two"): the engine's step
is torch work that releases the GIL for its kernels, and what the front end does per step is small
once a step's updates cross threads in one `call_soon_threadsafe` and each stream coalesces what
piled up into one SSE event. The two-process layout (`engine_process.py`, `--engine-process`) keeps
the HTTP work off the scheduler's interpreter at the price of encoding every update and a socket hop;
on this 2-core CPU it gave no more throughput (see RESULTS.md), so one process is the default and the
split remains one flag away for a GPU host whose steps are short enough for the front end to matter.

Threads: the engine thread is the only caller of `step()`; handlers only call the thread-safe
`add_request`/`abort` and wait on their `RequestStream`. Request preparation (tokenizing, the chat
template) runs in a one-thread pool, so a long prompt never stalls the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

from nanoplug.core.config import EngineConfig
from nanoplug.server._core_shim import EngineCore  # TEMPORARY: nanoplug.core.engine_core once it lands
from nanoplug.server.errors import APIError
from nanoplug.server.prepare import PromptChoices, prepare_all
from nanoplug.server.streams import RequestStream, Streams

log = logging.getLogger("nanoplug.server")


class EngineLoop:
    """One EngineCore stepped by a dedicated thread whenever it has unfinished requests."""

    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.config = self.core.config
        self.streams = Streams()
        self.stats = self.core.stats()  # replaced (never mutated) by the engine thread after each step
        self.failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._prepare = ThreadPoolExecutor(1, thread_name_prefix="nanoplug-prepare")

    # ------------------------------------------------------------------ what the server needs to know
    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="nanoplug-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------- handler side (loop)
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
        self._wake.set()
        return streams

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine frees the request's blocks at its next step and reports it finished."""
        if request_id in self.streams.open:
            self.core.abort(request_id)
            self._wake.set()

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise APIError(503, f"the engine stopped after an error: {self.failure}; restart the server",
                           type="server_error", code="engine_dead")

    # --------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        core, loop = self.core, self._loop
        try:
            while not self._stopping:
                self._wake.wait()
                self._wake.clear()
                while core.has_unfinished() and not self._stopping:
                    updates = core.step()
                    self.stats = core.stats()
                    if updates:
                        loop.call_soon_threadsafe(self.streams.deliver, updates)
        except BaseException as exc:  # a step that raises leaves the engine in an unknown state: stop serving
            self.failure = f"{type(exc).__name__}: {exc}"
            log.error("engine step failed; every open request ends with an error:\n%s", traceback.format_exc())
            error = APIError(500, f"the engine failed: {self.failure}", type="server_error", code="engine_error")
            loop.call_soon_threadsafe(self.streams.fail_all, error)

    def stop(self) -> None:
        """Stop the thread after its current step and release the engine (idempotent)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        self._prepare.shutdown(wait=False, cancel_futures=True)
        if self.core is not None:
            self.core.close()
            self.core = None
