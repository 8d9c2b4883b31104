"""Child processes that tests start, and the guarantee that none outlives its test.

A test that starts a process owns it until the process is gone, whatever happens to the test: an
assertion, a timeout, Ctrl-C, or a signal the test sent being ignored. So every process here starts
in a session of its own (a signal meant for it never reaches pytest, and its process group can be
killed whole), dies with pytest where Linux allows (the parent-death signal), and `Processes.close()`
(the `processes` fixture's finalizer in conftest.py, or `run`'s own `finally`) kills what is left:
its process group, every descendant (torchrun and nanoplug's tensor-parallel pool start their ranks
in sessions of their own), and the pids a test adopted (workers a helper reported: they outlive
their parent by up to a second before they notice it is gone).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Any, Iterable

import psutil

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def _die_with_parent(parent: int) -> None:
    """In the child between fork and exec: SIGKILL it when pytest dies (Linux only)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # pytest died before the line above took effect
            os._exit(1)


def _kill(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL each process still alive and wait for it (psutil refuses a pid reused by a stranger)."""
    procs = list(procs)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


class Processes:
    """The processes one test started; `close()` ends every one of them and what they started."""

    def __init__(self) -> None:
        self._popens: list[subprocess.Popen] = []
        self._adopted: list[psutil.Process] = []

    def popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        """`subprocess.Popen`, in its own session and process group, killed at `close()` if still running."""
        parent = os.getpid()
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: _die_with_parent(parent), **kwargs)
        self._popens.append(proc)
        return proc

    def run(self, cmd: list[str], *, timeout: float, capture_output: bool = False, input: Any = None,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """`subprocess.run` (a timeout is required); the process and all it started end before this returns."""
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        proc = self.popen(cmd, **kwargs)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        finally:
            self.end(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def adopt(self, pids: Iterable[int]) -> None:
        """Also kill these processes at `close()` (e.g. workers a helper process started)."""
        for pid in pids:
            try:
                self._adopted.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass

    def end(self, proc: subprocess.Popen) -> None:
        """Kill `proc`, its process group and its descendants if it is still running; reap it."""
        if proc.poll() is None:  # not reaped: its pid, and so its process group id, are still ours
            try:
                tree = [psutil.Process(proc.pid)]
                tree += tree[0].children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            _kill(tree)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # cannot happen after SIGKILL unless the kernel is stuck
            pass
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def close(self) -> None:
        """End every process this test started, and every adopted one."""
        for proc in self._popens:
            self.end(proc)
        _kill(self._adopted)
        self._popens, self._adopted = [], []


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """`Processes().run(...)` for module-level helpers that have no fixture at hand."""
    processes = Processes()
    try:
        return processes.run(cmd, **kwargs)
    finally:
        processes.close()


def gone(pids, within: float = 15.0) -> bool:
    """Whether every process of `pids` has exited (or is a zombie) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False
