"""Linear layers on the CPU with their weights packed once for MKL's float32 GEMM.

`F.linear` on the CPU hands the weight to MKL's sgemm, which re-packs it into its blocked layout on
every call. For the 4-64 token rows of a decode step that packing costs about as much as the multiply
itself (SmolLM2-135M's GEMMs at 32 rows: 1.25-2.2x faster packed, benchmarks/RESULTS.md). Packing
once at load (`cblas_sgemm_pack`, reached through `torch.ops.mkl`) removes it. The result is F.linear's
to float32 rounding (bit for bit from 16 rows with torch 2.13's MKL). Prefill-sized inputs keep
`F.linear`, which is as fast or faster there.

A layer opts in by having a `packed` attribute (None until packed); `linear()` is its forward. The
packed copy costs as much memory as the weight, so `pack_linear_weights` packs only when asked, or,
by default, when the copies fit in a quarter of the memory available.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("nanoplug")

MIN_ROWS, MAX_ROWS = 4, 64  # below: MKL's matrix-vector path is as fast; above: packing pays for itself


def _packed_mm(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # the last argument is the row count the packing is used for: the packed layout of the weight
    # does not depend on it (checked at start-up by _agrees), and giving x's own keeps MKL on it
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight when there is one and x has decode-sized rows."""
    if packed is not None and x.dim() == 2 and MIN_ROWS <= x.shape[0] <= MAX_ROWS:
        return _packed_mm(x, packed, weight, bias)
    return F.linear(x, weight, bias)


def unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why packing cannot serve here, or None."""
    if device.type != "cpu":
        return "only on the CPU"
    if dtype != torch.float32:
        return "MKL's packed GEMM is float32 only"
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        return "this torch build has no MKL"
    return None


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _agrees(module: nn.Module) -> bool:
    """The packed GEMM gives F.linear's result at every row count it serves (probed at both ends)."""
    weight = module.weight
    gen = torch.Generator().manual_seed(0)
    for rows in (MIN_ROWS, 5, 33, MAX_ROWS):
        x = torch.randn(rows, weight.shape[1], generator=gen)
        if not torch.allclose(_packed_mm(x, module.packed, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-5):
            return False
    return True


def pack_linear_weights(model: nn.Module, enabled: bool | None, dtype: torch.dtype, device: torch.device) -> int:
    """Pack the weight of every opted-in layer; returns the bytes packed (0: not packed, and why is logged).

    enabled: True packs whenever it can serve, False never, None when the copies fit in a quarter of
    the available memory."""
    if enabled is False:
        return 0
    reason = unavailable(dtype, device)
    layers = [m for m in model.modules() if hasattr(m, "packed") and isinstance(getattr(m, "weight", None), torch.Tensor)]
    size = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if reason is None and enabled is None:
        available = _available_memory()
        if available is None or 4 * size > available:
            reason = f"the packed copies ({size / 2**20:.0f} MiB) would not fit in a quarter of the available memory"
    if reason is None and not layers:
        reason = "the model has no layers that opt in (a `packed` attribute beside the weight)"
    if reason is not None:
        if enabled:
            log.warning("cpu_weight_packing: not packing: %s", reason)
        elif device.type == "cpu":  # by default on a GPU it is not news
            log.info("cpu_weight_packing: not packing: %s", reason)
        return 0
    for m in layers:
        m.packed = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), MAX_ROWS // 2)
    if not _agrees(layers[0]):
        for m in layers:
            m.packed = None
        log.warning("cpu_weight_packing: MKL's packed GEMM disagreed with F.linear here; using F.linear")
        return 0
    log.info("packed %d linear weights for MKL (%.0f MiB)", len(layers), size / 2**20)
    return size
