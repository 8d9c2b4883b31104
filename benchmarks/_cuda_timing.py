"""Timing a GPU call the way the micro-benchmarks do: a few warm-up calls, then CUDA events around many, queued
by the host (`cuda_ms`) or captured in one CUDA graph, which leaves out the launch overhead (`graph_us`)."""
from __future__ import annotations

import statistics
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


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Microseconds per call: `calls` launches captured in one CUDA graph (no launch overhead), median replay."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)
