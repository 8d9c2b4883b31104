"""The worker protocol: what the engine asks of the worker that runs its steps on one device, or of a
proxy that runs each call on every tensor-parallel rank and answers with rank 0's result.

Real methods, so a reader (or a type checker) can follow a step from the engine into the worker.
A proxy that must name a method in a message names it by `WorkerMethod`, never by a free string.
`WorkerReport` is what a worker says about itself (start-up's phases, what its decode steps ran as):
plain numbers, cheap to copy and to pickle across a proxy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

from nanoplug.api.step import StepBatch, StepResult


class WorkerMethod(Enum):
    """The methods of `Worker` a proxy may send to its ranks (pickled by name; checked on arrival)."""

    RUN = "run"
    LAUNCH = "launch"
    COLLECT = "collect"
    SAMPLE = "sample"  # a launched step's grammar bitmask (structured outputs), after its launch
    NUM_KV_BLOCKS = "num_kv_blocks"
    REPORT = "report"


@dataclass
class StepStats:
    """What the worker's steps since start-up ran as (start-up's own dummy steps not counted). A decode step
    replays a graph, or runs eager where a graph should have served it (the capture failed; with graphs
    working, never), or runs eager by design (graphs off here, or more sequences than the largest graph)."""

    graph_replays: int = 0
    eager_decode_steps: int = 0
    eager_decode_steps_by_design: int = 0
    prefill_graph_replays: int = 0  # prefill steps that replayed a graph (the rest of them run eager)

    @property
    def decode_steps(self) -> int:
        return self.graph_replays + self.eager_decode_steps + self.eager_decode_steps_by_design


@dataclass
class StartupTimes:
    """Seconds each start-up phase of a worker took, in the order they run (the device synchronized at each
    phase's end, so work a phase queued counts in it); the phases cover `total_s` end to end."""

    load_s: float  # the platform, the model built and its weights loaded
    kv_cache_s: float  # sizing (a profiling step, where the platform sizes by memory) and allocating the cache
    compile_s: float  # the platform's `prepare_model` (kernels that compile lazily do so in the warm-up's steps)
    warm_up_s: float  # the platform's `warm_up` steps
    graphs_s: float  # capturing decode graphs
    total_s: float

    def __str__(self) -> str:
        return (f"start-up {self.total_s:.3f} s = load {self.load_s:.3f} s + KV cache {self.kv_cache_s:.3f} s + "
                f"compile {self.compile_s:.3f} s + warm-up {self.warm_up_s:.3f} s + graphs {self.graphs_s:.3f} s")


@dataclass
class WorkerReport:
    """A worker's account of itself (rank 0's, through a proxy): a snapshot, not live state."""

    startup: StartupTimes
    stats: StepStats
    graphs_error: str | None  # why decode graphs the platform was asked for could not be captured
    graph_captures: int  # graphs captured (recorded) so far: start-up's, and none after


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

    defers_sampling = False
    """True when `sample` is implemented: a step launched with `sampling.mask_later` waits for its grammar bitmask
    (structured outputs), computed on the host while its forward runs. False: the engine collects the step
    before instead (no overlap while constrained requests run)."""

    def sample(self, bitmask) -> None:
        """Sample the step launched with `sampling.mask_later`, under `bitmask` (see `defers_sampling`), or under
        what `bitmask()` returns where it is a call: a worker may make that call as late as the next launch's
        first device work or the next collect (the engine passes its wait for the mask thread)."""
        raise NotImplementedError(f"{type(self).__name__} does not defer sampling")

    def load_adapter(self, adapter_id: int, spec) -> None:
        """Read the adapter `spec` names (an AdapterSpec) and serve it per request as id `adapter_id`, a slot
        no running request uses; called between steps (the engine's load_adapter)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load adapters at run time; give them at start-up")

    def shutdown(self) -> None:
        """Stop and release everything; safe to call twice."""

    def report(self) -> WorkerReport | None:
        """Start-up's phases and the steps' statistics (None: a worker that keeps none)."""
        return None

    def call(self, method: WorkerMethod, *args):
        """Run `method` of this worker (how a rank's server dispatches a proxy's message)."""
        if not isinstance(method, WorkerMethod):
            raise TypeError(f"workers run WorkerMethod members only, not {method!r}")
        return getattr(self, method.value)(*args)
