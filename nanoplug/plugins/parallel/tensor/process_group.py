"""A `ProcessGroup` over torch.distributed (NCCL on GPUs, gloo on CPU), the group `tensor` ranks share.

Every process holds exactly one engine's ranks, so the default (world) group is used: spawned
workers create it from the caller's store, and under torchrun the launcher's group is joined.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanoplug.api import ProcessGroup


class TorchGroup(ProcessGroup):
    """The tensor-parallel group: sum partial results and gather vocabulary shards."""

    def __init__(self, rank: int, world_size: int, local_rank: int):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"
