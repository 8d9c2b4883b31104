"""The linear method of GGUF blocks on the CPU: a layer's parts (q, k and v; gate and up; one for the
others) kept as loaded, packed once into the panels the C++ kernels read (kernels/cpu/quant.cpp for Q4_0,
Q4_1, Q5_0, Q8_0 and Q4_K; kernels/cpu/kquants.cpp for the other types in the file's blocks; each AVX-512 VNNI,
AVX2 or portable, chosen at run time), multiplied with the activations as `Activations` says, in both libraries
alike: by default with float32 compute's quality (float32 activations, or int8 blocks of x and of its residual),
never llama.cpp's plain int8 blocks, which loop the default model's answers.
The embedding and the tied LM head share one packed weight: rows are dequantized as they are gathered. Float
parts (an F32 or F16 tensor, or a type the format does not keep) stay dense."""
from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import LinearMethod, check_shape
from nanoplug.kernels.cpu.quant_ops import ACTS, SIMD_Q5_0, act_id

PANEL_FORMATS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K"})  # quant.cpp
BLOCK_FORMATS = frozenset({"Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS", "Q5_1", "IQ4_NL"})  # kquants.cpp
FORMATS = PANEL_FORMATS | BLOCK_FORMATS
"""The GGUF block types these kernels multiply."""
# Q5_0 holds d * (q - 16), q < 32: exactly the values of Q8_0 blocks. It stays in its 5.5 bits a weight (a
# decode step streams the weights: fewer bytes, a faster step) except beside Q8_0 parts of the same layer
# (llama.cpp's Q4_K_M: Q5_0 q and k, a Q8_0 v), kept as Q8_0 there so the layer is one segment (one kernel
# call, no concatenation), and where the panels have no SIMD path for Q5_0 (Arm: its Q8_0 one is faster).
WIDENED = {"Q5_0": "Q8_0"}


def q5_0_as_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks uint8 [rows, blocks * 22] (d float16, 32 high bits, 16 bytes of low nibbles) -> the Q8_0 blocks
    uint8 [rows, blocks * 34] (the same d, 32 int8 q - 16) of the same values."""
    rows = blocks.shape[0]
    b = blocks.reshape(-1, 22).to(torch.int32)
    qh = b[:, 2] | b[:, 3] << 8 | b[:, 4] << 16 | b[:, 5] << 24  # little-endian; bit j is weight j's fifth bit
    high = (qh[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    low = torch.cat([b[:, 6:] & 0xF, b[:, 6:] >> 4], dim=1)  # weight j < 16 in byte j's low nibble, j + 16 its high
    out = torch.empty(b.shape[0], 34, dtype=torch.uint8)
    out[:, :2] = blocks.reshape(-1, 22)[:, :2]
    out[:, 2:] = ((low | high << 4) - 16).to(torch.int8).view(torch.uint8)
    return out.reshape(rows, -1)


def cpu_method() -> "GGUFLinearMethod":
    """The method over the C++ kernels, built (compiled on first use) for this machine."""
    from nanoplug.kernels.cpu.kquant_ops import kquant_kernels
    from nanoplug.kernels.cpu.quant_ops import quant_kernels

    return GGUFLinearMethod(_ByFormat(quant_kernels(), kquant_kernels()))


class _ByFormat:
    """The two kernel libraries behind one interface: each call goes to the one serving its format."""

    def __init__(self, panels: Any, blocks: Any):
        self.panels, self.blocks = panels, blocks

    def _of(self, fmt: str) -> Any:
        return self.panels if fmt in PANEL_FORMATS else self.blocks

    def pack(self, fmt: str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
        return self._of(fmt).pack(fmt, raw, n, k)

    def storage(self, formats: set[str]) -> dict[str, str]:
        """The format each of a layer's block formats is kept in: the file's, or the wider one of WIDENED
        beside parts already in it (or where the panels have no SIMD path for the narrow one)."""
        native = self.panels.best in SIMD_Q5_0
        return {fmt: WIDENED[fmt] if fmt in WIDENED and (WIDENED[fmt] in formats or not native) else fmt
                for fmt in formats}

    def convert(self, fmt: str, to: str, raw: torch.Tensor) -> torch.Tensor:
        """Blocks of `fmt` as the blocks of `to` (the same values), from `storage`."""
        return raw if to == fmt else q5_0_as_q8_0(raw)

    def matmul(self, fmt: str, packed: torch.Tensor, n: int, k: int) -> Callable:
        """`mm(x, bias, act)`, `act` an index of ACTS (both libraries take every mode)."""
        return self._of(fmt).matmul(fmt, packed, n, k)

    def linear(self, x: torch.Tensor, fmt: str, packed: torch.Tensor, n: int, k: int,
               bias: torch.Tensor | None = None, act: str = "int8x2") -> torch.Tensor:
        return self._of(fmt).linear(x, fmt, packed, n, k, bias, act=act)

    def dequantize(self, fmt: str, packed: torch.Tensor, n: int, k: int, rows: torch.Tensor | None = None):
        return self._of(fmt).dequantize(fmt, packed, n, k, rows)


class Activations(NamedTuple):
    """How the activations meet the weights (modes of kernels/cpu/quant_ops.ACTS): `small` for inputs of
    up to `switch_rows` rows (decode, memory-bound), `large` above (prefill, large batches: compute-bound).
    `measured`: chosen by timing the panels (kernels/cpu/choices.py), so a block format (BLOCK_FORMATS), whose
    float path dequantizes each row and is far slower, takes int8x2 (float32 compute's quality too) where that
    choice says float; an explicit choice is taken as it is."""

    small: str = "int8x2"
    switch_rows: int = 0
    large: str = "int8x2"
    measured: bool = False

    def for_blocks(self) -> "Activations":
        """The modes a block format takes."""
        if not self.measured:
            return self
        swap = {"float": "int8x2"}
        return self._replace(small=swap.get(self.small, self.small), large=swap.get(self.large, self.large))

    def mode(self, rows: int) -> str:
        return self.small if rows <= self.switch_rows else self.large


class Segment(NamedTuple):
    """Rows [offset, offset + rows) of a layer's weight: packed blocks of `fmt`, or float32 [rows, cols] (fmt None)."""

    offset: int
    rows: int
    fmt: str | None
    data: torch.Tensor


class _Weight:
    """One layer's weight: its parts as loaded (row offset, tensor), then the segments packed from them.
    It lives on the `weight` parameter, so a tied LM head shares it with the embedding."""

    def __init__(self, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        self.parts: list[tuple[int, Any]] = []
        self.segments: list[Segment] | None = None
        self.mm: Callable | None = None  # the matmul of a weight that is one quantized segment (the usual case)


def _format(tensor: Any) -> str | None:
    """A part's block format (a GGUFTensor's type), None for a float tensor."""
    return None if isinstance(tensor, torch.Tensor) else tensor.type_name


class GGUFLinearMethod(LinearMethod):
    keeps_experts = True  # an MoE's experts in their blocks, a 2-D layer each (one rank)
    dequantized_experts = True  # under tensor parallelism: dense, dequantized at load

    def __init__(self, kernels: Any, activations: Activations = Activations()):
        self.kernels = kernels
        self.set_activations(activations)

    def set_activations(self, activations: Activations) -> None:
        """Use `activations` from the next call on (a recorded decode step keeps the mode it recorded)."""
        self.activations = activations
        blocks = activations.for_blocks()
        self._switch = activations.switch_rows
        # (small, large) mode ids by whether a segment's format is a block format
        self._ids = {False: (act_id(activations.small), act_id(activations.large)),
                     True: (act_id(blocks.small), act_id(blocks.large))}

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.gguf = _Weight(output_size, input_size)
        layer.register_parameter("weight", weight)

    def load(self, layer: nn.Module, param: torch.Tensor, tensor: Any, out_offset: int, out_size: int) -> None:
        check_shape(tensor, (out_size, param.gguf.cols), type(layer).__name__)
        param.gguf.parts.append((out_offset, tensor))

    def process_after_loading(self, layer: nn.Module) -> None:
        """Pack the parts: consecutive parts kept in one block format become one segment (q, k and v: one
        kernel call), float parts a dense one."""
        param = layer.weight
        w: _Weight = param.gguf
        if w.segments is not None:  # a tied LM head: packed with the embedding
            return
        parts = sorted(w.parts, key=lambda p: p[0])
        starts = [sum(t.shape[0] for _, t in parts[:i]) for i in range(len(parts) + 1)]
        if [o for o, _ in parts] != starts[:-1] or starts[-1] != w.rows:
            raise ValueError(f"{type(layer).__name__} got rows {[(o, t.shape[0]) for o, t in parts]} of its "
                             f"{w.rows}; each must be loaded once")
        w.segments = []
        kept = self.kernels.storage({_format(t) for _, t in parts} - {None})
        kept[None] = None
        for fmt, group in itertools.groupby(parts, key=lambda p: kept[_format(p[1])]):
            group = list(group)
            rows = sum(t.shape[0] for _, t in group)
            if fmt is None:
                data = torch.cat([t.float() for _, t in group]).contiguous()
            else:  # parts of one kept format (Q5_0 q and k, Q8_0 v: one Q8_0 segment, one kernel call)
                blocks = torch.cat([self.kernels.convert(_format(t), fmt, t.blocks()) for _, t in group])
                data = self.kernels.pack(fmt, blocks, rows, w.cols)
            w.segments.append(Segment(group[0][0], rows, fmt, data))
        w.parts = []
        if len(w.segments) == 1:  # the parameter holds the bytes (what memory accounting and moves see)
            param.data = w.segments[0].data
            if w.segments[0].fmt is not None:
                w.mm = self.kernels.matmul(w.segments[0].fmt, w.segments[0].data, w.rows, w.cols)
        else:  # several: one buffer, the segments views of it
            sizes = [(seg.data.numel() * seg.data.element_size() + 63) // 64 * 64 for seg in w.segments]
            flat, start = torch.empty(sum(sizes), dtype=torch.uint8), 0
            for i, (seg, size) in enumerate(zip(w.segments, sizes)):
                view = flat[start:start + seg.data.numel() * seg.data.element_size()].view(seg.data.dtype)
                view = view.view(seg.data.shape)
                view.copy_(seg.data)
                w.segments[i] = seg._replace(data=view)
                start += size
            param.data = flat

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w: _Weight = layer.weight.gguf
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        big = rows > self._switch
        if w.mm is not None:
            return w.mm(x, bias, self._ids[w.segments[0].fmt in BLOCK_FORMATS][big])
        outs = []
        for offset, rows, fmt, data in w.segments:
            part_bias = None if bias is None else bias[offset:offset + rows]
            if fmt is None:
                outs.append(F.linear(x, data, part_bias))
            else:
                act = ACTS[self._ids[fmt in BLOCK_FORMATS][big]]
                outs.append(self.kernels.linear(x.reshape(-1, w.cols), fmt, data, rows, w.cols, part_bias, act=act))
        return torch.cat(outs, dim=-1)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        w: _Weight = layer.weight.gguf
        if len(w.segments) == 1:
            seg = w.segments[0]
            if seg.fmt is None:
                return F.embedding(ids, seg.data)
            return self.kernels.dequantize(seg.fmt, seg.data, w.rows, w.cols, ids)
        return F.embedding(ids, self.dequantized(layer))  # rows of several formats: rare (no GGUF writer splits one)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The whole weight in float32 [rows, cols] (gguf-py's values for the quantized segments)."""
        w: _Weight = layer.weight.gguf
        return torch.cat([data if fmt is None else self.kernels.dequantize(fmt, data, rows, w.cols)
                          for _, rows, fmt, data in w.segments])
