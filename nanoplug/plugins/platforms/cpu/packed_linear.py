"""The `cpu` platform's linear method: dense float32 weights, packed once for a decode-sized GEMM.

`F.linear` on the CPU hands the weight to MKL's sgemm, which re-packs it into its blocked layout on
every call. For the few token rows of a decode step that packing costs about as much as the multiply
itself. Packing once at load removes it. Two GEMMs can read a packed weight:

- nanoplug's own (the `kernels` beside this module, when they build here): panels that stream from memory while
  the previous block is multiplied, for 2-64 rows; on SmolLM2-135M's 121 GEMMs at 32 rows 34.8 ms
  against MKL's packed 45.7 and F.linear's 59.1 (benchmarks/cpu_gemm.py, RESULTS.md);
- MKL's packed sgemm (`cblas_sgemm_pack` through `torch.ops.mkl`), for 4-64 rows, where the kernels
  cannot be built.

Both give F.linear's result to float32 rounding (checked at start-up); prefill-sized inputs keep
`F.linear`. `PackedLinearMethod` gives each linear layer and the LM head of the layer library a
`packed` attribute (None until packed) and packs it after loading; `linear()` is its apply. The packed
copy costs as much memory as the weight, so it packs only when asked, or, by default, when the copies
fit in a quarter of the memory available.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import DenseLinearMethod

log = logging.getLogger("nanoplug")

# one row: F.linear's matrix-vector path is as fast (MKL's packed GEMM from 4 rows, nanoplug's from 2);
# above 64 rows F.linear, compute-bound there, is faster
MKL_MIN_ROWS, NANOPLUG_MIN_ROWS, MAX_ROWS = 4, 2, 64


class PackedWeight(NamedTuple):
    """A weight's packed copy and the GEMM that reads it, for inputs of min_rows..max_rows rows."""

    data: torch.Tensor
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    min_rows: int
    max_rows: int


def _mkl_mm(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # the last argument is the row count the packing is used for: the packed layout of the weight
    # does not depend on it (checked at start-up by _agrees), and giving x's own keeps MKL on it
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight when there is one and x has decode-sized rows."""
    if packed is not None and x.dim() == 2 and packed.min_rows <= x.shape[0] <= packed.max_rows:
        return packed.mm(x, packed.data, weight, bias)
    return F.linear(x, weight, bias)


def unavailable(dtype: torch.dtype, device: torch.device, kernels: Any = None) -> str | None:
    """Why packing cannot serve here, or None."""
    if device.type != "cpu":
        return "only on the CPU"
    if dtype != torch.float32:
        return "the packed GEMMs are float32 only"
    if kernels is None and (not torch.backends.mkl.is_available()
                            or not hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")):
        return "this torch build has no MKL and nanoplug's CPU kernels are not in use"
    return None


def _packer(kernels: Any) -> Callable[[torch.Tensor], PackedWeight]:
    """nanoplug's GEMM when its kernels are loaded, else MKL's."""
    if kernels is not None:
        return lambda w: PackedWeight(kernels.pack_weight(w), kernels.linear, NANOPLUG_MIN_ROWS, MAX_ROWS)
    return lambda w: PackedWeight(torch.ops.mkl._mkl_reorder_linear_weight(w, MAX_ROWS // 2), _mkl_mm,
                                  MKL_MIN_ROWS, MAX_ROWS)


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
    """The packed GEMM gives F.linear's result at the row counts it serves (both ends and between)."""
    weight, packed = module.weight, module.packed
    gen = torch.Generator().manual_seed(0)
    for rows in sorted({packed.min_rows, packed.min_rows + 1, 33, packed.max_rows}):
        x = torch.randn(rows, weight.shape[1], generator=gen)
        if not torch.allclose(packed.mm(x, packed.data, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-5):
            return False
    return True


class PackedLinearMethod(DenseLinearMethod):
    """Dense weights; after loading, each linear layer's (and the LM head's) packed for the GEMM.

    enabled: True packs whenever it can serve, False never, None when the copies fit in a quarter of
    the available memory. kernels: nanoplug's loaded CPU kernels (their GEMM), or None for MKL's.
    The decision is made once, at the first layer loaded, for the total its `create_weights` saw."""

    def __init__(self, enabled: bool | None, dtype: torch.dtype, device: torch.device, kernels: Any = None):
        self.enabled, self.dtype, self.device, self.kernels = enabled, dtype, device, kernels
        self.planned = 0  # bytes of the weights it would pack
        self.packing: bool | None = None  # None: not decided yet
        self.checked = False
        self.packed_bytes = self.packed_layers = 0

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_size, dtype)
        if getattr(layer, "role", "linear") != "embedding":  # embeddings never multiply: nothing to pack
            layer.packed = None
            self.planned += input_size * output_size * dtype.itemsize

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.packed)

    def process_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "packed") or not isinstance(getattr(layer, "weight", None), torch.Tensor):
            return
        if self.packing is None:
            self.packing = self._decide()
        if not self.packing:
            return
        layer.packed = _packer(self.kernels)(layer.weight.detach())
        if not self.checked:  # the first layer packed stands for all: they share the GEMM
            self.checked = True
            if not _agrees(layer):
                layer.packed, self.packing = None, False
                log.warning("cpu_weight_packing: %s disagreed with F.linear here; using F.linear", self.gemm)
                return
        self.packed_bytes += layer.weight.numel() * layer.weight.element_size()
        self.packed_layers += 1

    @property
    def gemm(self) -> str:
        return "nanoplug's CPU GEMM" if self.kernels is not None else "MKL's packed GEMM"

    def _decide(self) -> bool:
        """Whether to pack, logging why not (a warning when asked for, info on a CPU by default)."""
        if self.enabled is False:
            return False
        reason = unavailable(self.dtype, self.device, self.kernels)
        if reason is None and self.enabled is None:
            available = _available_memory()
            if available is None or 4 * self.planned > available:
                reason = f"the packed copies ({self.planned / 2**20:.0f} MiB) would not fit in a quarter of the available memory"
        if reason is not None:
            if self.enabled:
                log.warning("cpu_weight_packing: not packing: %s", reason)
            elif self.device.type == "cpu":  # by default on a GPU it is not news
                log.info("cpu_weight_packing: not packing: %s", reason)
            return False
        return True

    def log_summary(self) -> None:
        if self.packed_layers:
            log.info("packed %d linear weights for %s (%.0f MiB)", self.packed_layers, self.gemm,
                     self.packed_bytes / 2**20)


def pack_linear_weights(model: nn.Module, enabled: bool | None, dtype: torch.dtype, device: torch.device,
                        kernels: Any = None) -> int:
    """Pack the weight of every layer of `model` that has a `packed` attribute, as the method does after
    loading; returns the bytes packed (0: not packed, and why is logged)."""
    layers = [m for m in model.modules() if hasattr(m, "packed") and isinstance(getattr(m, "weight", None), torch.Tensor)]
    method = PackedLinearMethod(enabled, dtype, device, kernels)
    method.planned = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    for m in layers:
        method.process_after_loading(m)
    method.log_summary()
    return method.packed_bytes
