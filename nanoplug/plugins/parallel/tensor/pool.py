"""The caller's side of spawned tensor-parallel workers: start them, call them in lockstep, stop them.

Every rank, rank 0 included, runs in a worker process, so the caller never blocks inside a
collective: whatever a worker does (raises, crashes, hangs), the caller is waiting on sockets with
a deadline and can report it. Two engines in one process own separate workers and process groups.
The rendezvous store listens on a port the OS picks, so engines on one host never collide.
"""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nanoplug.api import NanoplugError, StepBatch, StepResult, Worker, WorkerMethod, WorkerReport
from nanoplug.plugins.parallel.tensor.rank import STORE_HOST, receive, send

TIMEOUT_ENV = "NANOPLUG_TP_TIMEOUT"
START_TIMEOUT_ENV = "NANOPLUG_TP_START_TIMEOUT"
ERROR_GRACE_S = 0.5  # after a first error, how long to wait for the other ranks' reports


class WorkerError(NanoplugError, RuntimeError):
    """A tensor-parallel worker raised, crashed or timed out; the engine's workers are stopped."""


def timeout_from_env(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        return float(value) if value else default
    except ValueError:
        raise NanoplugError(f"{name}={value!r} is not a number of seconds") from None


@dataclass
class _Handles:
    """What must be released when the engine goes away (shared with the finalizer, never the pool)."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    store: Any = None


def _release(handles: _Handles, graceful: bool) -> None:
    """Stop every worker (politely when `graceful`, else at once), then close sockets and the store."""
    if graceful:
        for conn in handles.conns:
            try:
                send(conn, ("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in handles.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for proc in handles.procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in handles.procs:
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in handles.conns:
        conn.close()
    handles.procs, handles.conns, handles.store = [], [], None


def _worker_env() -> dict[str, str]:
    """The caller's environment, with this nanoplug first on the path (it may not be installed)."""
    import nanoplug

    root = str(Path(nanoplug.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class WorkerPool(Worker):
    """`world_size` worker processes on this host, one rank each: the `Worker` the engine drives is this
    proxy, whose every method runs on every rank and answers with rank 0's result."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.call_timeout = timeout_from_env(TIMEOUT_ENV, 600.0)
        self.start_timeout = timeout_from_env(START_TIMEOUT_ENV, max(1800.0, self.call_timeout))
        self._handles = _Handles()
        self._finalizer = weakref.finalize(self, _release, self._handles, True)  # also runs at exit
        self._stopped_because: str | None = None
        self._unanswered_launch = False  # a launch was sent since the last answer: that answer covers it too

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._handles.procs]

    worker_pids = pids  # the worker processes this engine started

    # ------------------------------------------------------------------ the worker protocol
    def run(self, step: StepBatch) -> StepResult | None:
        return self._call(WorkerMethod.RUN, step)

    def launch(self, step: StepBatch) -> None:
        """Hand every rank the step and return: no rank answers a launch (see worker.py), so the engine can
        launch the next step before it collects this one; a rank that fails in it says so at that collect."""
        self._check_running()
        self._round(("call", WorkerMethod.LAUNCH, (step,)), "'launch'", self.call_timeout, answered=False)
        self._unanswered_launch = True

    def collect(self) -> StepResult | None:
        return self._call(WorkerMethod.COLLECT)

    defers_sampling = True  # every rank's runner samples after its launch; the bitmask follows the launch

    def sample(self, bitmask: Any) -> None:
        """Hand every rank the launched step's grammar bitmask (filled on the host while the ranks ran its
        forward) and return: unanswered, as a launch; rank 0 samples under it at once (a call for the bitmask
        is made now: the ranks need the array)."""
        if callable(bitmask):
            bitmask = bitmask()
        self._check_running()
        self._round(("call", WorkerMethod.SAMPLE, (bitmask,)), "'sample'", self.call_timeout, answered=False)
        self._unanswered_launch = True

    def num_kv_blocks(self) -> int:
        return self._call(WorkerMethod.NUM_KV_BLOCKS)

    def report(self) -> WorkerReport | None:
        return self._call(WorkerMethod.REPORT)  # rank 0's

    def shutdown(self) -> None:
        self.stop()

    # ---------------------------------------------------------------------------- start
    def start(self, factory: Any, backend: str, cpu_threads: int | None) -> None:
        h = self._handles
        try:
            h.store = dist.TCPStore(STORE_HOST, 0, None, True, timeout=timedelta(seconds=self.start_timeout),
                                    wait_for_workers=False)
            init = ("init", list(sys.path), pickle.dumps(factory), h.store.port, self.world_size, backend,
                    self.call_timeout, cpu_threads)
            for rank in range(self.world_size):
                self._spawn(rank)
        except BaseException as exc:
            self._stop(graceful=False, reason=f"{type(exc).__name__} while starting workers")
            raise
        self._round(init, "start-up (loading the model)", self.start_timeout)

    def _spawn(self, rank: int) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self._handles.procs.append(subprocess.Popen(
                [sys.executable, "-m", "nanoplug.plugins.parallel.tensor.rank", str(theirs.fileno()), str(rank),
                 str(os.getpid())],
                pass_fds=(theirs.fileno(),), start_new_session=True,  # Ctrl-C reaches the caller only
                stdin=subprocess.DEVNULL, env=_worker_env(),
            ))
        self._handles.conns.append(Connection(ours.detach()))

    # ----------------------------------------------------------------------------- calls
    def _check_running(self) -> None:
        if self._stopped_because is not None:
            raise WorkerError(f"the tensor-parallel workers are stopped ({self._stopped_because}); create a new LLM")

    def _call(self, method: WorkerMethod, *args: Any) -> Any:
        self._check_running()
        what = repr(method.value) + (" or the 'launch' before it" if self._unanswered_launch else "")
        results = self._round(("call", method, args), what, self.call_timeout)
        self._unanswered_launch = False
        return results[0]

    def _round(self, message: Any, what: str, timeout: float, answered: bool = True) -> list[Any] | None:
        """Send `message` to every rank and gather the replies (`answered`); on any failure stop all and raise."""
        try:
            for rank, conn in enumerate(self._handles.conns):
                try:
                    send(conn, message)
                except OSError:
                    raise self._died(rank, what) from None
            return self._gather(what, timeout) if answered else None
        except BaseException as exc:  # a worker error, a timeout, or Ctrl-C: no worker may be left mid-step
            self._stop(graceful=False, reason=f"{type(exc).__name__} during {what}")
            raise

    def _gather(self, what: str, timeout: float) -> list[Any]:
        conns = self._handles.conns
        pending = {conn: rank for rank, conn in enumerate(conns)}
        results: list[Any] = [None] * len(conns)
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, min(1.0, left)))
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    kind, value = receive(conn)
                except (EOFError, OSError):
                    errors[rank] = self._died(rank, what).args[0]
                    continue
                if kind == "error":
                    errors[rank] = value
                else:
                    results[rank] = value
            if errors:
                break
            if not ready:
                self._check_alive(what)
                if left <= 0:
                    raise WorkerError(
                        f"tensor-parallel workers gave no answer to {what} within {timeout:.0f} s; a rank may be "
                        f"hung in a collective. Raise {TIMEOUT_ENV} (seconds) if the work is just slow"
                    )
        if errors:
            errors.update(self._late_errors(pending, what))
            raise WorkerError(self._describe(errors, what))
        return results

    def _late_errors(self, pending: dict[Connection, int], what: str) -> dict[int, str]:
        """Reports that other ranks send just after the first one (shown after it)."""
        found: dict[int, str] = {}
        for conn in wait(list(pending), timeout=ERROR_GRACE_S):
            try:
                kind, value = receive(conn)
            except (EOFError, OSError):
                continue
            if kind == "error":
                found[pending[conn]] = value
        return found

    def _describe(self, errors: dict[int, str], what: str) -> str:
        ranks = ("rank " if len(errors) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(errors))
        parts = [f"tensor-parallel worker {ranks} failed during {what}; all workers are stopped."]
        parts += [f"--- rank {rank} ---\n{text.rstrip()}" for rank, text in sorted(errors.items())]
        return "\n".join(parts)

    def _check_alive(self, what: str) -> None:
        for rank, proc in enumerate(self._handles.procs):
            if proc.poll() is not None:
                raise self._died(rank, what)

    def _died(self, rank: int, what: str) -> WorkerError:
        proc = self._handles.procs[rank]
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exited with code {code}" if code is not None else "closed its connection"
        return WorkerError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how} during {what}; "
            "its own messages on stderr say why (out of memory, a crash, a signal)"
        )

    # ------------------------------------------------------------------------------ stop
    def _stop(self, graceful: bool, reason: str) -> None:
        self._stopped_because = self._stopped_because or reason
        self._finalizer.detach()
        _release(self._handles, graceful)

    def stop(self) -> None:
        """Stop every worker; safe to call twice."""
        if self._finalizer.alive:
            self._stop(graceful=True, reason="the engine was closed")
