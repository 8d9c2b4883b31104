"""The worker protocol: what the engine asks of the worker that runs its steps on one device, or of a
proxy that runs each call on every tensor-parallel rank and answers with rank 0's result.

Real methods, so a reader (or a type checker) can follow a step from the engine into the worker.
A proxy that must name a method in a message names it by `WorkerMethod`, never by a free string.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum

from nanoplug.api.step import StepBatch, StepResult


class WorkerMethod(Enum):
    """The methods of `Worker` a proxy may send to its ranks (pickled by name; checked on arrival)."""

    RUN = "run"
    LAUNCH = "launch"
    COLLECT = "collect"
    NUM_KV_BLOCKS = "num_kv_blocks"


class Worker(ABC):
    """Runs steps on one device (or, as a proxy, on every rank in lockstep)."""

    @abstractmethod
    def run(self, step: StepBatch) -> StepResult | None:
        """Compute one step; rank 0 returns its sampled tokens and asked-for logits rows."""

    @abstractmethod
    def launch(self, step: StepBatch) -> None:
        """Queue one step's device work without waiting; at most one step may be uncollected when the next is launched."""

    @abstractmethod
    def collect(self) -> StepResult | None:
        """Wait for the oldest launched step's result."""

    @abstractmethod
    def num_kv_blocks(self) -> int:
        """How many KV blocks the engine may hand out (the scratch block not counted)."""

    def shutdown(self) -> None:
        """Stop and release everything; safe to call twice."""

    def call(self, method: WorkerMethod, *args):
        """Run `method` of this worker (how a rank's server dispatches a proxy's message)."""
        if not isinstance(method, WorkerMethod):
            raise TypeError(f"workers run WorkerMethod members only, not {method!r}")
        return getattr(self, method.value)(*args)
