"""The linear-method seam (the shape of vLLM's quantization methods): how one layer's weight is
created, loaded and applied.

The layer library (`nanoplug.api.layers`) owns sharding: it narrows each checkpoint tensor to this
rank's rows (or columns) and hands them to `LinearMethod.load`. The method owns the format: what
parameters a layer has, how they are filled, and how `x @ W.T + b` is computed from them. So a weight
format (int8, GGUF, fp8) or a device's fast GEMM is a method, and no model file changes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api.errors import WeightShapeError


@dataclass(frozen=True)
class ExpertRows:
    """An MoE's experts kept quantized with one scale per output row, stacked as the fused MoE kernels read them:
    values of `dtype` [E, rows, cols] and float32 scales [E, rows]. `quantize(w)` takes one expert's whole
    [rows, cols] weight to (values, scales [rows]); tensor parallelism narrows both after."""

    dtype: torch.dtype
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LinearMethod(ABC):
    """How one layer's weight is created, loaded and applied; dense (the default) keeps today's code."""

    dequantized_experts: bool = False
    """True when a mixture-of-experts model may keep its experts dense under this method, each expert's
    checkpoint tensor dequantized at load (the loader does it for a floating-point parameter, and logs it): a
    format whose kernels serve 2-D layers only (GGUF). False: such a model is refused (a format that quantizes on
    load would silently not)."""

    keeps_experts: bool = False
    """True when an MoE's experts stay in this method's format, each expert's two projections 2-D layers of this
    method (created, loaded and applied as any layer; on one rank: under tensor parallelism `dequantized_experts`
    decides). The experts are most of an MoE's weights: dequantized, a 4-bit file would not fit where it should."""

    expert_rows: ExpertRows | None = None
    """Set when this method quantizes an MoE's experts per output row on load (fp8): they stay stacked, in the
    fused kernels' layout, on any number of ranks; `keeps_experts` and `dequantized_experts` then do not apply."""

    def stacked_experts(self, num_experts: int, rows: int, cols: int, parts: int, dtype: torch.dtype
                        ) -> nn.Module | None:
        """One projection of an MoE's experts kept in this method's format, stacked and run by its own kernels (a
        `layers.moe.StackedExperts`: GGUF under Triton), on one rank; None (the default): this method has none,
        and `expert_rows`, `keeps_experts` or `dequantized_experts` decide. `rows` of every expert, loaded in
        `parts` (gate and up: 2) of rows / parts each."""
        return None

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        """Register the layer's parameters (this rank's sizes). Each parameter carries
        `weight_loader(param, tensor, shard_id=None)`, the layer's own loader, which shards/packs and
        hands the format's data to `self.load(layer, param, tensor, shard_offset, shard_size)`.

        The default: a dense `weight [output_size, input_size]` of `dtype`."""
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", weight)

    def load(self, layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, out_offset: int, out_size: int) -> None:
        """Copy `tensor` (this rank's rows, already narrowed) into rows [out_offset, out_offset+out_size)
        of `param`, checking the shape (a mismatch names the layer, expected and found shape)."""
        dst = param.data.narrow(0, out_offset, out_size) if (out_offset, out_size) != (0, param.shape[0]) else param.data
        copy_weight(dst, tensor, type(layer).__name__)

    def process_after_loading(self, layer: nn.Module) -> None:
        """Called once per layer after every weight is loaded (and merged): pack, transpose, quantize."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` for this layer's weight in this method's format."""

    def apply_float32(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` as float32, not rounded to x's dtype (the LM head's logits: a 16-bit rounding of the
        logits, 0.06 at a logit of 10 in bf16, parts near ties either way). The default rounds through `apply`;
        a method that can write its float32 accumulators directly overrides it."""
        return self.apply(layer, x, None).float()

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight for token ids (embeddings; a tied LM head shares the weight)."""
        return F.embedding(ids, layer.weight)


_MM_OUT_DTYPE = [hasattr(torch.ops.aten.mm, "dtype")]  # torch >= 2.8; cleared if this build refuses it
WIDEN_ROWS = 1024  # weight rows widened at a time where no mixed-precision product exists (CPU)


def wide_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` of two 16-bit operands of one dtype, as float32: cuBLAS writes its float32 accumulators
    (`mm`'s `out_dtype`) on CUDA; elsewhere the operands are widened first (exact: the products are the same),
    the weight a slice at a time, so that each slice's float32 copy is read from cache (widening a whole LM head
    at once cost a CPU many times the 16-bit product)."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            y = torch.ops.aten.mm.dtype(flat, weight.t(), torch.float32)
        except (RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
        else:
            return y.reshape(*x.shape[:-1], weight.shape[0])
    flat = flat.float()
    y = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], WIDEN_ROWS):
        part = weight[start:start + WIDEN_ROWS]
        torch.mm(flat, part.float().t(), out=y[:, start:start + part.shape[0]])
    return y.reshape(*x.shape[:-1], weight.shape[0])


class DenseLinearMethod(LinearMethod):
    """Plain weights of the model's dtype and `F.linear`: the default, and the reference for every other."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def apply_float32(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(layer, "weight", None)
        if (x.dtype in (torch.bfloat16, torch.float16) and isinstance(weight, torch.Tensor)
                and weight.dtype == x.dtype):
            return wide_linear(x, weight)
        return super().apply_float32(layer, x)


def check_shape(tensor: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    """Raise WeightShapeError unless `tensor` has exactly the `expected` shape.

    Every weight loader calls this on the full checkpoint tensor before it narrows or copies, so
    `narrow` never cuts a tensor that does not split evenly and `copy_` never broadcasts one. The
    engine's loader words the error again with the tensor's name and file."""
    found, expected = list(tensor.shape), list(expected)
    if found != expected:
        detail = f"shape {found}, but the model expects {expected}{f' ({what})' if what else ''}"
        err = WeightShapeError(f"a tensor of {detail}")
        err.detail = detail
        raise err


def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str = "") -> None:
    """`dst.copy_(src)` with the shapes checked first (copy_ would broadcast a [1, n] tensor silently)."""
    check_shape(src, dst.shape, what)
    dst.copy_(src)
