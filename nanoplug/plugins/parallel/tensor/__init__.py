"""Parallel strategy `tensor`: every layer split over `tensor_parallel_size` ranks (Megatron-style).

Attention heads and MLP columns are split; row-parallel projections and the vocabulary-parallel
embedding sum their parts with an all-reduce, and the LM head gathers the vocabulary shards. The
ranks talk through torch.distributed: NCCL on GPUs, gloo on CPU.

Two ways to get the ranks:
- on one host, the engine starts one worker process per rank and drives them (`pool.py`);
- under torchrun (or any torch.distributed launcher, several hosts included), each launched
  process is one rank and they all run the same requests (`joined.py`).

Both overlap steps: `launch` returns once every rank holds the step (no rank answers it), `collect`
answers with rank 0's tokens, and each rank gets rank 0's sampled tokens on its device (runner.py),
which the next step may read its inputs from.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from nanoplug.api import ParallelStrategy, ProcessGroup, Target, Worker


def _split_reasons(target: Target, n: int) -> list[str]:
    """What of the model does not split into `n` equal parts."""
    facts = target.model
    if facts is None:
        return []
    counts = {"attention heads": facts.num_heads, "KV heads": facts.num_kv_heads}
    intermediate = facts.intermediate_size
    if intermediate:
        counts["MLP intermediate size"] = intermediate
    bad = [f"the {count} {what}" for what, count in counts.items() if count % n]
    reasons = []
    if bad:
        fits = [d for d in range(1, facts.num_heads + 1) if all(c % d == 0 for c in counts.values())]
        reasons.append(f"tensor_parallel_size={n} does not divide {' and '.join(bad)}; "
                       f"sizes that do: {', '.join(map(str, fits))}")
    if facts.vocab_size < n:
        reasons.append(f"the vocabulary ({facts.vocab_size}) is smaller than tensor_parallel_size={n}")
    return reasons


def _device_reasons(target: Target, n: int) -> list[str]:
    import torch.distributed as dist

    from nanoplug.plugins.parallel.tensor.joined import launched_local_rank, launched_ranks, launched_world_size

    kind = target.device.type
    if kind not in ("cuda", "cpu"):
        return [f"runs on CUDA (NCCL) or CPU (gloo), not on {kind}"]
    if kind == "cuda" and not dist.is_nccl_available():
        return ["this torch build has no NCCL; use device='cpu' (gloo) or a CUDA build of torch"]
    if kind == "cpu" and not dist.is_gloo_available():
        return ["this torch build has no gloo backend for CPU tensor parallelism"]
    if launched_ranks():
        world = launched_world_size()
        if world != n:
            return [f"the torch.distributed job has {world} processes but tensor_parallel_size={n}; "
                    f"start it with --nproc-per-node/--nnodes giving {n} processes in all, or pass "
                    f"tensor_parallel_size={world}"]
        gpus = torch.cuda.device_count() if kind == "cuda" else 0
        if kind == "cuda" and launched_local_rank() >= gpus:
            return [f"LOCAL_RANK={launched_local_rank()} but this host has {gpus} GPUs; "
                    "start at most one process per GPU on each host"]
        return []
    if kind == "cuda" and torch.cuda.device_count() < n:
        return [f"tensor_parallel_size={n} needs {n} GPUs but torch sees {torch.cuda.device_count()}; "
                "lower tensor_parallel_size or make more GPUs visible (CUDA_VISIBLE_DEVICES)"]
    return []


class TensorParallel(ParallelStrategy):
    description = "layers split over GPUs (NCCL) or CPU processes (gloo); spawned workers, or torchrun's ranks"
    priority = 50  # `single` (100) wins under "auto" when tensor_parallel_size is 1
    supports_overlap = True  # the spawned pool and torchrun's ranks alike

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        import torch.distributed as dist

        if not dist.is_available():
            return ["this torch build has no torch.distributed"]
        n = target.tensor_parallel_size
        return _split_reasons(target, n) + _device_reasons(target, n)

    def start(self, make_worker: Callable[[ProcessGroup], Worker]) -> Worker:
        """A proxy worker: the spawned pool's, or, under torchrun, this rank's own joined to the others."""
        from nanoplug.plugins.parallel.tensor.joined import JoinedRanks, launched_ranks
        from nanoplug.plugins.parallel.tensor.pool import TIMEOUT_ENV, WorkerPool, timeout_from_env
        from nanoplug.plugins.parallel.tensor.process_group import backend_for

        device_type = self.target.device.type
        backend = backend_for(device_type)
        if launched_ranks():
            ranks = JoinedRanks(timeout_from_env(TIMEOUT_ENV, 600.0))
            ranks.start(make_worker, backend)
            return ranks
        n = self.target.tensor_parallel_size
        cpu_threads = None
        if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            cpu_threads = max(1, cores // n)  # the ranks share this host's cores
        pool = WorkerPool(n)
        pool.start(make_worker, backend, cpu_threads)
        return pool
