"""Every rank's graph-capture outcome, known to every rank: tensor-parallel ranks must all replay or all
run eager. One replaying a graph while another runs the same step eager runs different collectives (or
the same ones in another order), which deadlocks NCCL; so a capture that fails on one rank leaves every
rank eager, and the report names the rank that failed and why.

Two all-gathers over the ranks' own group (the byte length of each rank's error, then the padded
bytes), once at start-up. It reconciles failures that leave the capture's own collectives matched:
raised before the capture runs any step, or after its last one (a check, an instantiation). A rank
that fails halfway through the steps a capture runs leaves the others waiting in the model's
collectives; the parallel strategy's call deadline reports that one.
"""
from __future__ import annotations

import torch

from nanoplug.api import ProcessGroup

MAX_BYTES = 4096  # of each rank's error kept in the report


def capture_failures(group: ProcessGroup, error: str | None, device: torch.device) -> dict[int, str]:
    """{rank: why its capture failed} over all ranks, the same on every rank (this rank's alone at world size 1)."""
    if group.world_size == 1:
        return {group.rank: error} if error is not None else {}
    data = (error or "").encode()[:MAX_BYTES] or (b"" if error is None else b"?")
    lengths = group.all_gather(torch.tensor([len(data)], dtype=torch.int64, device=device), dim=0).tolist()
    width = max(lengths)
    if width == 0:
        return {}
    mine = torch.tensor(list(data) + [0] * (width - len(data)), dtype=torch.uint8)
    every = group.all_gather(mine.to(device), dim=0).view(group.world_size, width).cpu()
    return {rank: bytes(every[rank, :n].tolist()).decode(errors="replace")
            for rank, n in enumerate(lengths) if n}


def describe(failures: dict[int, str], world_size: int) -> str:
    """One line for the report: the error itself in one process, else which ranks failed and why."""
    if world_size == 1:
        return next(iter(failures.values()))
    ranks = ", ".join(map(str, sorted(failures)))
    whys = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(failures.items()))
    return (f"decode graph capture failed on rank{'s' if len(failures) > 1 else ''} {ranks} of {world_size}, so "
            f"every rank decodes eager (ranks that replay and ranks that run eager would deadlock) -- {whys}")
