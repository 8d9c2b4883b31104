"""C++ kernels for float32 steps on the CPU, built once per machine at first use.

A decode step of a small model on a CPU spends as long in its ~1,000 small ops (norms, RoPE, SiLU,
gathering K/V for attention) as in its GEMMs, because each eager op pays dispatch and a pass over
memory; and MKL's GEMM leaves memory and compute mostly in sequence at decode sizes. These kernels
do each small op in one pass and a decode-sized GEMM with its weights streaming in the background:
`kernels()` returns them (or raises `KernelsUnavailable` with the reason), `usable(...)` decides for an
engine. The `cpu` platform puts the fused ops into the model (`fused_ops`), packs the linear weights
for their GEMM (`packed_linear.py`) and gives the sampler their argmax; the `cpu` attention backend
runs decode attention on the paged cache.
"""
from __future__ import annotations

import functools
import logging

import torch

from nanoplug.api import FusedOps
from nanoplug.kernels.cpu.build import KernelsUnavailable, library_path
from nanoplug.kernels.cpu.ops import DECODE_HEAD_DIMS, MAX_DECODE_GROUP, CpuKernels

log = logging.getLogger("nanoplug")
__all__ = ["CpuKernels", "KernelsUnavailable", "kernels", "unavailable", "usable", "fused_ops", "DECODE_HEAD_DIMS",
           "MAX_DECODE_GROUP"]


@functools.lru_cache(maxsize=1)
def _load() -> CpuKernels | str:
    try:
        return CpuKernels(library_path())
    except (KernelsUnavailable, OSError) as exc:
        return str(exc)


def kernels() -> CpuKernels:
    """The loaded kernels (built on first call); raises KernelsUnavailable with the reason."""
    loaded = _load()
    if isinstance(loaded, str):
        raise KernelsUnavailable(loaded)
    return loaded


def unavailable() -> str | None:
    """Why the kernels cannot run here (building them if needed), or None."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def usable(enabled: bool | None, dtype: torch.dtype, device: torch.device) -> CpuKernels | None:
    """The kernels for an engine, or None (and why is logged: a warning when they were asked for).

    enabled: True must, None does when they build here, False never."""
    if enabled is False:
        return None
    if device.type != "cpu" or dtype != torch.float32:
        reason = f"they serve float32 on the CPU, this run is {str(dtype).removeprefix('torch.')} on {device}"
    else:
        reason = unavailable()
    if reason is not None:
        if enabled:
            log.warning("cpu_kernels: not used: %s", reason)
        elif device.type == "cpu":  # on a GPU it is not news
            log.info("cpu_kernels: not used: %s", reason)
        return None
    ops = kernels()
    log.info("cpu_kernels: in use for the GEMMs and greedy argmax (%s)", ops.path)
    return ops


def fused_ops(ops: CpuKernels) -> FusedOps:
    """The kernels' RMSNorm, add + RMSNorm, SiLU-and-mul and RoPE, for a model's `install_fused_ops`."""
    return FusedOps(rms_norm=ops.rms_norm, add_rms_norm=ops.add_rms_norm, silu_and_mul=ops.silu_and_mul, rope=ops.rope)
