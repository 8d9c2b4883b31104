"""Parallel strategy `single`: the whole model in this process, on one device."""
from __future__ import annotations

from typing import Any, Callable

import torch

from nanoplug.core.hookspecs import hookimpl
from nanoplug.core.interfaces import PLUGIN_API_VERSION, ParallelStrategy, ProcessGroup, Target
from nanoplug.plugins.parallel.layers import Layers

NANOPLUG_API_VERSION = PLUGIN_API_VERSION


class LocalGroup(ProcessGroup):
    """A group of one: reductions are the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def layers(self) -> Layers:
        return Layers(self)


class SingleDevice(ParallelStrategy):
    description = "one process, one device"
    priority = 100
    supports_overlap = True

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        n = target.config.tensor_parallel_size
        return [] if n == 1 else [f"serves tensor_parallel_size=1 only (asked {n}); use parallel='tensor'"]

    def start(self, make_worker: Callable[[ProcessGroup], Any]) -> None:
        self.worker = make_worker(LocalGroup())

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def shutdown(self) -> None:
        self.worker = None


@hookimpl
def nanoplug_register_parallel(register) -> None:
    register.add("single", SingleDevice)
