"""Parallel strategy `single`: the whole model in this process, on one device; the worker is the runner itself."""
from __future__ import annotations

from typing import Callable

import torch

from nanoplug.api import ParallelStrategy, ProcessGroup, Target, Worker


class LocalGroup(ProcessGroup):
    """A group of one: reductions are the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


class SingleDevice(ParallelStrategy):
    description = "one process, one device"
    priority = 100
    supports_overlap = True

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        n = target.tensor_parallel_size
        return [] if n == 1 else [f"serves tensor_parallel_size=1 only (asked {n}); use parallel='tensor'"]

    def start(self, make_worker: Callable[[ProcessGroup], Worker]) -> Worker:
        return make_worker(LocalGroup())
