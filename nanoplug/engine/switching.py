"""The process's GIL switch interval, shortened while a thread works beside a loop that must stay responsive.

A thread that runs Python (or C that takes the GIL back often) beside an event loop or a step loop makes that loop
wait up to CPython's switch interval (5 ms) each time it wants the GIL, several times for one small task. While
such work runs (a structured-output mask fill, a large request body parsed off the server's event loop) the
interval is 0.1 ms. Counted, so overlapping users share it and the last one puts the old value back.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator

SWITCH_INTERVAL = 1e-4  # seconds: how often the GIL changes hands while fast switching is on


class FastSwitching:
    def __init__(self):
        self.lock, self.active, self.saved = threading.Lock(), 0, None

    def enter(self) -> None:
        with self.lock:
            if self.active == 0:
                self.saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self.saved, SWITCH_INTERVAL))
            self.active += 1

    def leave(self) -> None:
        with self.lock:
            self.active -= 1
            if self.active == 0:
                sys.setswitchinterval(self.saved)


fast_switching = FastSwitching()


@contextmanager
def switching_fast() -> Iterator[None]:
    fast_switching.enter()
    try:
        yield
    finally:
        fast_switching.leave()
