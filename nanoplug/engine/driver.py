"""`Driver`: the one owner of `EngineCore.step()`, for `LLM` and for the server in both layouts.

A thread steps the core while it has unfinished work and hands each step's updates to the sink that
submitted their request: one `deliver(updates)` call per sink per step, so a server that owns all
its requests through one sink pays one hand-off per step, whatever the batch. Everyone else only
uses the core's thread-safe `make_request`, `add_request` and `abort`, then wakes the driver.

A caller that would only block until its own requests finish (a lone `LLM.generate`) may instead run
the steps on its own thread through `step_here()` while the driver's thread has no work in hand: a
hand-off between threads costs a GIL switch (up to `sys.getswitchinterval()`, 5 ms) per delivery. The
wheel lock keeps it one stepper at a time whichever thread that is.

A step that raises leaves the engine in a state only its owner can judge: every sink with a request
in flight is failed with the exception (`fail(exc)`), `failure` records it, and the driver waits for
the next wake (`LLM` raises it in each caller and lets them abort; the server stops serving).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Protocol

log = logging.getLogger("nanoplug.engine")


class Sink(Protocol):
    """Where a request's updates go; both methods are called on the driver's thread and must not block."""

    def deliver(self, updates: list[Any]) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class Driver:
    def __init__(self, core: Any, on_idle: Callable[[Any], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None, stop_on_failure: bool = False):
        """`on_idle(stats)` once each time the core runs out of work (so idle stats are fresh);
        `on_failure(exc)` after a step raised and every open sink was failed with it; `stop_on_failure`:
        step no more after that (a server's engine is dead; an `LLM`'s callers may abort and go on)."""
        self.core, self.on_idle, self.on_failure = core, on_idle, on_failure
        self.stop_on_failure = stop_on_failure
        self.stats = core.stats()  # replaced (never mutated) after each step: safe to read from any thread
        self.failure: BaseException | None = None  # the exception of the last step that raised, if any
        self._sink_of: dict[str, Sink] = {}  # request id -> its sink, until its last update
        self._cond = threading.Condition(threading.Lock())  # guards _sink_of, _woken, _idle, _stopping
        self._woken = False
        self._idle = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._wheel = threading.Lock()  # held by whichever thread runs a step

    # --------------------------------------------------------------------------- any thread
    def submit(self, requests: Iterable[Any], sink: Sink, wake: bool = True) -> None:
        """Queue `requests` (EngineRequests, already checked) whose updates go to `sink`. All or none:
        if the core refuses one, those already queued are aborted and the error is raised. `wake=False`:
        the caller steps them itself (`step_here`)."""
        requests = list(requests)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine driver is stopped")
            for r in requests:
                self._sink_of[r.request_id] = sink
        added = []
        try:
            for r in requests:
                self.core.add_request(r)
                added.append(r.request_id)
        except BaseException:
            with self._cond:
                for r in requests:
                    if r.request_id not in added:
                        self._sink_of.pop(r.request_id, None)
            for request_id in added:
                self.core.abort(request_id)
            self.wake()
            raise
        if wake:
            self.wake()

    def abort(self, request_id: str) -> None:
        """The core drops the request at its next step; its last update ("abort") goes to its sink."""
        self.core.abort(request_id)
        self.wake()

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="nanoplug-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def step_here(self) -> bool:
        """Run one step on the calling thread, if the core has work and the driver's thread has none in
        hand (it is idle and not woken) and no one else is stepping; its updates go to their sinks as
        the thread's would, and a step that raises fails them the same way. Returns whether it stepped."""
        with self._cond:
            if self._stopping or self._woken or not self._idle:
                return False
        if not self._wheel.acquire(blocking=False):
            return False
        try:
            core = self.core
            if not core.has_unfinished():
                return False
            try:
                self._step()
                if self.on_idle is not None and not core.has_unfinished():
                    self.on_idle(self.stats)
            except BaseException as exc:  # noqa: BLE001 (handed to the sinks)
                self._failed(exc)
            return True
        finally:
            self._wheel.release()

    def between_steps(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the calling thread while no step runs (the wheel held, so at most one step's wait): for
        changes to the core that a step must never see half done, such as an adapter loaded at run time."""
        with self._wheel:
            return fn(*args)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the driver has no work in hand (its last step ran out of work or raised)."""
        with self._cond:
            return self._cond.wait_for(lambda: (self._idle and not self._woken) or self._thread is None
                                       or self._stopping, timeout)

    def stop(self, error: BaseException | None = None, timeout: float = 60) -> None:
        """Stop after the current step (idempotent). Requests still open are left to their owners, or,
        given `error`, their sinks are failed with it (a caller blocked on its sink hears why)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout=timeout)
        if error is not None:
            self._fail_sinks(error)

    # ------------------------------------------------------------------------ driver thread
    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._woken and not self._stopping:
                    cond.wait()
                if self._stopping:
                    self._idle = True
                    cond.notify_all()
                    return
                self._woken, self._idle = False, False
            try:
                self._steps()
            except BaseException as exc:  # noqa: BLE001 (handed to the sinks)
                self._failed(exc)
            with cond:
                self._idle = True
                cond.notify_all()

    def _steps(self) -> None:
        core = self.core
        stepped = False
        wheel = self._wheel
        while not self._stopping and core.has_unfinished():
            with wheel:  # a caller's step_here may still be finishing its step
                if not core.has_unfinished():
                    break
                self._step()
                stepped = True
        if stepped:
            if self.on_idle is not None:
                self.on_idle(self.stats)

    def _step(self) -> None:
        """One step (the wheel held), its stats kept and its updates handed to their sinks."""
        updates = self.core.step()
        self.stats = self.core.stats()
        if updates:
            self._deliver(updates)

    def _deliver(self, updates: list[Any]) -> None:
        """Each sink's share of one step's updates, in one call per sink."""
        sink_of = self._sink_of
        by_sink: dict[int, tuple[Sink, list[Any]]] = {}
        with self._cond:
            for u in updates:
                sink = sink_of.get(u.request_id)
                if sink is None:
                    continue  # not submitted through the driver
                if u.finished:
                    del sink_of[u.request_id]
                by_sink.setdefault(id(sink), (sink, []))[1].append(u)
        for sink, mine in by_sink.values():
            sink.deliver(mine)

    def _failed(self, exc: BaseException) -> None:
        self.failure = exc
        if self.stop_on_failure:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
        self._fail_sinks(exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    def _fail_sinks(self, exc: BaseException) -> None:
        with self._cond:
            sinks = {id(s): s for s in self._sink_of.values()}
            self._sink_of.clear()
        for sink in sinks.values():
            try:
                sink.fail(exc)
            except Exception:  # noqa: BLE001 (one sink's trouble must not keep the others from hearing)
                log.exception("a sink failed to take the engine's error")
