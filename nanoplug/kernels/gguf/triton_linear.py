"""The linear method of GGUF blocks under Triton (triton_kernels.py): a layer's parts (q, k and v; gate and
up) kept per run of one format, each run repacked once (blocks.py) and written by its own kernel into its
columns of one output, so a fused layer whose parts differ in format still makes one tensor without a
concatenation. Q8_0/Q4_0/Q4_1/Q4_K are split into quants and scales (blocks.py, triton_kernels.py); the
other types stay the file's blocks (triton_kquants.py). Parts that arrive as floats (an F16 embedding) stay
dense in the model's dtype. The embedding gathers dequantized rows; a tied LM head shares the embedding's
blocks."""
from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import LinearMethod, Target, check_shape, import_reason
from nanoplug.kernels.gguf import triton_kernels as kernels
from nanoplug.kernels.gguf import triton_kquants
from nanoplug.kernels.gguf.blocks import Packed, repack
from nanoplug.kernels.gguf.triton_experts import StackedGGUFExperts
from nanoplug.kernels.gguf.triton_kquants import RawBlocks


def _quantized(weight) -> bool:
    """A weight in blocks (the classes looked up now: a test may reload triton_kquants under the interpreter)."""
    return isinstance(weight, (Packed, triton_kquants.RawBlocks))


def _module(weight: Packed | RawBlocks):
    """The kernels of a weight's layout."""
    return kernels if isinstance(weight, Packed) else triton_kquants


def triton_reasons(target: Target) -> list[str]:
    """Why the Triton GGUF kernels cannot serve `target` (empty: they can)."""
    reasons = [r for r in [import_reason(kernels.TRITON_ERROR)] if r]
    if target.device.type == "cuda":
        if target.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            reasons.append(f"its kernels compute in bfloat16, float16 or float32, not {target.dtype}")
    elif target.device.type == "cpu" and kernels.interpreting():
        if target.dtype != torch.float32:
            reasons.append("under the Triton interpreter it computes in float32 (pass dtype='float32')")
    else:
        reasons.append(f"its Triton kernels need CUDA (device is {target.device.type}); on CPU only with "
                       "TRITON_INTERPRET=1, for tests")
    if target.tensor_parallel_size != 1:
        reasons.append("it serves one rank (tensor_parallel_size=1)")
    return reasons


class Segment(NamedTuple):
    """Output rows [offset, offset + rows): a Packed weight, or a dense tensor [rows, cols] of the model's dtype."""

    offset: int
    rows: int
    weight: Packed | RawBlocks | torch.Tensor


class _Weight:
    """One layer's weight: the parts as loaded, then its segments. Lives on the `weight` parameter, so a
    tied LM head shares it with the embedding."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        self.rows, self.cols, self.dtype = rows, cols, dtype
        self.parts: list[tuple[int, Any]] = []
        self.segments: list[Segment] | None = None


def _is_blocks(tensor: Any) -> bool:
    return not isinstance(tensor, torch.Tensor)  # a GGUFTensor of a block format


class TritonGGUFLinearMethod(LinearMethod):
    # (the format serves one rank, where an MoE's experts are stacked; were it split, they would be dequantized)
    dequantized_experts = True

    def stacked_experts(self, num_experts: int, rows: int, cols: int, parts: int, dtype: torch.dtype) -> nn.Module:
        """On one rank an MoE's experts stay in their blocks, stacked (triton_experts.py)."""
        return StackedGGUFExperts(num_experts, rows, cols, parts, dtype, self)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.gguf = _Weight(output_size, input_size, dtype)
        layer.register_parameter("weight", weight)

    def load(self, layer: nn.Module, param: torch.Tensor, tensor: Any, out_offset: int, out_size: int) -> None:
        check_shape(tensor, (out_size, param.gguf.cols), type(layer).__name__)
        param.gguf.parts.append((out_offset, tensor))

    def process_after_loading(self, layer: nn.Module) -> None:
        """Repack each run of parts of one block format into one Packed weight on the layer's device (an MoE's
        stacked experts: into one weight of them all)."""
        if isinstance(layer, StackedGGUFExperts):
            return layer.finish()
        param = layer.weight
        w: _Weight = param.gguf
        if w.segments is not None:  # a tied LM head: done with the embedding
            return
        device = param.device
        parts = sorted(w.parts, key=lambda p: p[0])
        starts = [sum(t.shape[0] for _, t in parts[:i]) for i in range(len(parts) + 1)]
        if [o for o, _ in parts] != starts[:-1] or starts[-1] != w.rows:
            raise ValueError(f"{type(layer).__name__} got rows {[(o, t.shape[0]) for o, t in parts]} of its "
                             f"{w.rows}; each must be loaded once")
        w.segments = []
        for fmt, group in itertools.groupby(parts, key=lambda p: p[1].type_name if _is_blocks(p[1]) else None):
            group = list(group)
            rows = sum(t.shape[0] for _, t in group)
            if fmt is None:
                data = torch.cat([t.to(device, w.dtype) for _, t in group]).contiguous()
            else:
                blocks = torch.cat([t.blocks() for _, t in group])
                blocks = blocks.to(device)
                data = (triton_kquants.raw_blocks if fmt in triton_kquants.FORMATS else repack)(fmt, blocks, rows, w.cols)
            w.segments.append(Segment(group[0][0], rows, data))
        w.parts = []
        first = w.segments[0].weight  # the parameter holds the largest bytes (what memory accounting sees)
        param.data = first.quants if isinstance(first, Packed) else first.data if isinstance(first, triton_kquants.RawBlocks) else first

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w: _Weight = layer.weight.gguf
        x2 = x.reshape(-1, w.cols)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], w.rows, dtype=x.dtype, device=x.device)
        for offset, rows, weight in w.segments:
            dst = out if rows == w.rows else out[:, offset:offset + rows]
            if _quantized(weight):
                _module(weight).linear(x2, weight, dst)
            else:
                dst.copy_(F.linear(x2, weight))
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], w.rows)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        w: _Weight = layer.weight.gguf
        if len(w.segments) == 1:
            weight = w.segments[0].weight
            if not _quantized(weight):
                return F.embedding(ids, weight)
            flat = ids.reshape(-1)
            out = torch.empty(flat.numel(), w.cols, dtype=w.dtype, device=ids.device)
            return _module(weight).dequantize(weight, out, flat).view(*ids.shape, w.cols)
        return F.embedding(ids, self.dequantized(layer))  # rows of several formats: rare

    def dequantized(self, layer: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight [rows, cols] in `dtype` (the model's by default), dequantized by the kernel."""
        w: _Weight = layer.weight.gguf
        dtype = dtype or w.dtype
        outs = []
        for _, rows, weight in w.segments:
            if _quantized(weight):
                device = weight.quants.device if isinstance(weight, Packed) else weight.data.device
                outs.append(_module(weight).dequantize(weight, torch.empty(rows, w.cols, dtype=dtype, device=device)))
            else:
                outs.append(weight.to(dtype))
        return torch.cat(outs)
