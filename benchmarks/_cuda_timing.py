"""Timing a GPU call the way the micro-benchmarks do: a few warm-up calls, then CUDA events around many."""
from __future__ import annotations

from typing import Callable


def cuda_ms(fn: Callable[[], object], iters: int = 50, warmup: int = 3) -> float:
    """Milliseconds per call of `fn`, averaged over `iters` calls queued back to back."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
