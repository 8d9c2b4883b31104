"""An MoE's experts kept in their GGUF blocks on the GPU: each projection's experts stacked into one weight of
E * rows rows (the file's blocks of every expert, one after another, in the Triton kernels' layout), so that
one GEMV launch runs every (token, slot) pair of a decode step, each program column reading its pair's expert
(the kernels' `experts` argument), and one dequantize launch gives the fused path every expert for a step of
more pairs than that costs bytes for (`pair_limit`: 6-8x the experts for a 4-bit format under bf16). The expert
chosen is read on the device: no host sync, so CUDA graphs capture both. Experts that arrive as floats, or whose
parts differ in format, are held dense instead.
"""
from __future__ import annotations

import torch

from nanoplug.api.layers import StackedExperts
from nanoplug.kernels.gguf import triton_kernels as kernels
from nanoplug.kernels.gguf import triton_kquants
from nanoplug.kernels.gguf.blocks import Packed, repack


class StackedGGUFExperts(StackedExperts):
    """One projection of every expert: `stacked` is a Packed or RawBlocks weight [E * rows, cols] once loaded
    (`finish`), or a dense tensor [E, rows, cols] of the model's dtype."""

    def __init__(self, num_experts: int, rows: int, cols: int, parts: int, dtype: torch.dtype, method):
        super().__init__(num_experts, rows, cols, parts, dtype)
        self.linear_method = method  # the runner hands this module to method.process_after_loading once loaded
        self.stacked: Packed | triton_kquants.RawBlocks | torch.Tensor | None = None

    def finish(self) -> None:
        """Stack the loaded experts on this module's device, in their blocks where all share one kept format."""
        device = self.weight.device
        tensors = self.take_loaded()
        formats = {None if isinstance(t, torch.Tensor) else t.type_name for t in tensors}
        total = self.num_experts * self.rows
        if len(formats) == 1 and None not in formats:
            fmt = formats.pop()
            blocks = torch.cat([t.blocks() for t in tensors]).to(device)
            make = triton_kquants.raw_blocks if fmt in triton_kquants.FORMATS else repack
            self.stacked = make(fmt, blocks, total, self.cols)
            self.weight.data = self.stacked.quants if isinstance(self.stacked, Packed) else self.stacked.data
            # the pairs' reads of blocks cost fewer bytes than dequantizing every expert (its blocks read, the
            # model's dtype written and read again) while pairs < E * (1 + 2 * dtype bytes / block bytes a weight)
            per_weight = self.stacked.nbytes / (total * self.cols)
            self.pair_limit = int(self.num_experts * (1 + 2 * self.dtype.itemsize / per_weight))
        else:
            dense = [t.dequantize() if not isinstance(t, torch.Tensor) else t for t in tensors]
            self.stacked = torch.cat([t.to(device, self.dtype) for t in dense]).view(self.num_experts, self.rows,
                                                                                     self.cols)
            self.quantized = False
            self.weight.data = self.stacked  # (what memory accounting sees)

    def _kernels(self):
        return kernels if isinstance(self.stacked, Packed) else triton_kquants

    def pairs(self, x: torch.Tensor, ids: torch.Tensor, x_div: int) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.rows, dtype=x.dtype, device=x.device)
        return self._kernels().gemv(x.contiguous(), self.stacked, out, experts=(ids, x_div))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.quantized:
            return self.stacked.to(dtype)
        out = torch.empty(self.num_experts * self.rows, self.cols, dtype=dtype, device=self.weight.device)
        return self._kernels().dequantize(self.stacked, out).view(self.num_experts, self.rows, self.cols)
