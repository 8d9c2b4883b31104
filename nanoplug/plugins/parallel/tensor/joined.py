"""Tensor parallelism inside processes a launcher started (torchrun, or any torch.distributed setup).

Every launched process builds the same `LLM` and calls `generate` with the same requests, so every
rank's scheduler makes the same decisions. Before each step the ranks compare a digest of the step
(different requests on different ranks fail loudly instead of deadlocking), and after it rank 0's
sampled tokens are broadcast, so every rank appends the same tokens and returns the same outputs.
Both go through a gloo group on the CPU, so they never wait for the device: over NCCL they would
queue behind the step just launched and undo overlapped steps. A launch broadcasts nothing; the
collect after it carries rank 0's result.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from nanoplug.api import NanoplugError, StepBatch, StepResult, Worker, WorkerMethod, WorkerReport
from nanoplug.plugins.parallel.tensor.process_group import TorchGroup

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_ranks() -> bool:
    """True when this process is one rank of a torch.distributed job (set up already, or by torchrun's env)."""
    if not dist.is_available():
        return False
    return dist.is_initialized() or all(k in os.environ for k in LAUNCHER_ENV)


def launched_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])


def launched_local_rank() -> int:
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    gpus = torch.cuda.device_count()
    return rank % gpus if gpus else rank


class JoinedRanks(Worker):
    """This process is one rank; the launcher started (and will stop) the others. As a `Worker`, each
    method runs on this rank's own worker in lockstep with the others and returns rank 0's result."""

    def __init__(self, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
        self.worker: Any = None
        self.host_group: Any = None  # gloo, for the host's messages; None: the launcher's group is gloo already

    def start(self, make_worker: Callable[[TorchGroup], Any], backend: str) -> None:
        local_rank = launched_local_rank()
        if not dist.is_initialized():
            device_id = None
            if backend == "nccl":
                device_id = torch.device("cuda", local_rank)
                torch.cuda.set_device(device_id)
            dist.init_process_group(backend, timeout=self.timeout, device_id=device_id)  # env:// from torchrun
        self.host_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=self.timeout)
        self.worker = make_worker(TorchGroup(dist.get_rank(), dist.get_world_size(), local_rank))

    def run(self, step: StepBatch) -> StepResult | None:
        return self._call(WorkerMethod.RUN, step)

    def launch(self, step: StepBatch) -> None:
        """Check the step is every rank's and queue it; rank 0's result comes with the `collect` after it."""
        self._call(WorkerMethod.LAUNCH, step)

    def collect(self) -> StepResult | None:
        return self._call(WorkerMethod.COLLECT)

    def num_kv_blocks(self) -> int:
        return self._call(WorkerMethod.NUM_KV_BLOCKS)

    def report(self) -> WorkerReport | None:
        return self._call(WorkerMethod.REPORT)  # rank 0's

    def shutdown(self) -> None:
        self.stop()

    def _call(self, method: WorkerMethod, *args: Any) -> Any:
        if self.worker is None:
            raise NanoplugError("this tensor-parallel engine is closed; create a new LLM")
        if args:
            self._check_same_step(method, args)
        box = [self.worker.call(method, *args)]
        if method is WorkerMethod.LAUNCH:
            return None
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def _check_same_step(self, method: WorkerMethod, args: tuple) -> None:
        digest = hashlib.blake2b(pickle.dumps((method.value, args)), digest_size=7).digest()
        mine = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine, group=self.host_group)
        differ = [r for r, d in enumerate(every) if int(d) != int(every[0])]
        if differ:
            raise NanoplugError(
                f"ranks {differ} scheduled a different step than rank 0: every process of the torchrun job must "
                "build the same LLM and call generate with the same prompts and SamplingParams"
            )

    def stop(self) -> None:
        self.worker = None  # the launcher owns the processes and the process group
