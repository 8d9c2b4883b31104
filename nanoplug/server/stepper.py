"""The thread that steps an EngineCore whenever it has unfinished requests, and nothing else.

Both engine layouts use it: in the server's process (engine_loop.py) it hands each step's updates
to the event loop; in an engine process of its own (engine_process.py) it writes them to the socket.
It is the only caller of `core.step()`; everyone else uses the core's thread-safe add/abort and
then `wake()`s it.
"""
from __future__ import annotations

import logging
import threading
import traceback
from typing import Any, Callable

log = logging.getLogger("nanoplug.server")


class Stepper:
    def __init__(self, core: Any, on_step: Callable[[list[Any], Any], None], on_failure: Callable[[str], None]):
        """`on_step(updates, stats)` after every step that produced updates, and once more when the core
        runs out of work (so idle stats are fresh); `on_failure(reason)` if a step raises."""
        self.core, self.on_step, self.on_failure = core, on_step, on_failure
        self.stats = core.stats()  # replaced (never mutated) after each step: safe to read from any thread
        self.failure: str | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nanoplug-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stopping:
                self._wake.wait()
                self._wake.clear()
                stepped = False
                while core.has_unfinished() and not self._stopping:
                    updates = core.step()
                    self.stats = stats = core.stats()
                    stepped = True
                    if updates:
                        self.on_step(updates, stats)
                if stepped:
                    self.on_step([], self.stats)
        except BaseException as exc:  # a step that raises leaves the engine in an unknown state: stop serving
            self.failure = f"{type(exc).__name__}: {exc}"
            log.error("engine step failed; every open request ends with an error:\n%s", traceback.format_exc())
            self.on_failure(self.failure)

    def stop(self, timeout: float = 60) -> None:
        """Stop after the current step (idempotent)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
