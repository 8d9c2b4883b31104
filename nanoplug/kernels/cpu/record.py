"""The kernel libraries' calls, seen by a recording (nanoplug/plugins/platforms/cpu/graphs.py).

A C kernel is called through ctypes with raw addresses, which torch never sees; so each library is
loaded behind `RecordingLib`, whose functions also append the call to the recording in progress on
this thread, if any. Outside a recording a call costs one thread-local lookup more.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

_state = threading.local()


def active_plan() -> list[Callable[[], Any]] | None:
    """The list the calls of this thread are recorded into, or None."""
    return getattr(_state, "plan", None)


def set_plan(plan: list[Callable[[], Any]] | None) -> None:
    _state.plan = plan


class _Recorded:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        plan = getattr(_state, "plan", None)
        if plan is not None:
            plan.append(functools.partial(self.fn, *args))
        return self.fn(*args)


class RecordingLib:
    """A loaded ctypes library whose named functions are recorded when a recording is active."""

    def __init__(self, lib: Any, names: list[str]):
        self.raw = lib
        for name in names:
            setattr(self, name, _Recorded(getattr(lib, name)))
