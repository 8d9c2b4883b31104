"""What the pre-quantized checkpoint formats share (compressed_tensors, gptq, awq, fp8_checkpoint): each
layer's tensors (qweight, scales, zeros...) joined into one `QuantizedWeight` on the way in (`regroup`), and
one linear method that keeps it as stored and multiplies it:

- a kernel per kind and device, chosen once after loading (quant_kernels.py): int4 W4A16 (Triton on CUDA,
  C++ on CPU), int8 W8A8 (torch._int_mm on CUDA, C++ on CPU), fp8 per channel (torch._scaled_mm on sm89+),
  fp8 blocks (a Triton block-scaled fp8 GEMM on sm89+);
- where none serves (fp8 on a CPU or a pre-Ada GPU, odd shapes), the reference path, which the kernels are
  tested against: the activations quantized as the checkpoint says (per token, or per group of 128
  columns: kernels/quant/activations.py) and multiplied with the dequantized weight (kernels/quant/int4.py,
  fp8.py) by F.linear.

A layer the checkpoint left unquantized (compressed-tensors' `ignore`) arrives as a plain weight and is
kept dense. The embedding and LM head stay dense.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import DenseLinearMethod, LinearMethod, ModelLoadError, Target, WeightFormat
from nanoplug.kernels.quant import fp8 as fp8_kernels
from nanoplug.kernels.quant import int4
from nanoplug.kernels.quant.activations import fake_quantize
from nanoplug.plugins.weight_formats import quant_kernels

FP8 = getattr(torch, "float8_e4m3fn", None)


@dataclass
class QuantizedWeight:
    """One layer's weight as a checkpoint stores it: `kind` (int4 | int8 | fp8 | fp8_block), the logical
    shape [N, K] the layers check, and its tensors in `kernels/quant`'s layouts."""

    kind: str
    shape: torch.Size
    tensors: dict[str, torch.Tensor]
    block: tuple[int, int] | None = None  # fp8_block: the [rows, cols] a scale covers
    act: tuple[str, int | None] | None = None  # dynamic activation quantization: (int | float, group or None)

    def dim(self) -> int:
        return 2

    def is_floating_point(self) -> bool:
        return False


@dataclass
class Parts:
    """A layer's checkpoint tensors seen so far, by suffix."""

    file: Any = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class PrequantizedFormat(WeightFormat):
    """A checkpoint format whose linear layers are stored quantized: subclasses say which suffixes make a
    layer (`suffixes`), when a layer's set is complete (`complete`) and how it becomes a QuantizedWeight."""

    suffixes: tuple[str, ...] = ()

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if target.tensor_parallel_size != 1:
            return ["it serves one rank (tensor_parallel_size=1); quantization=None dequantizes the weights"]
        return []

    def __init__(self, target: Target, hf_config: Any):
        super().__init__(target, hf_config)
        qconfig = getattr(hf_config, "quantization_config", None) or {}
        self.qconfig = qconfig if isinstance(qconfig, dict) else qconfig.to_dict()
        why = self.refuses()
        if why:
            raise ModelLoadError(f"this {self.quant_method} checkpoint cannot be served: {why}")

    def refuses(self) -> str | None:
        """Why the checkpoint's quantization_config asks for something this format does not do (None: it is served)."""
        return None

    def complete(self, parts: dict[str, torch.Tensor]) -> bool:
        raise NotImplementedError

    def convert(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        raise NotImplementedError

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix in self.suffixes

    def regroup(self, tensors: Iterator[tuple[Any, str, Any]]) -> Iterator[tuple[Any, str, Any]]:
        pending: dict[str, Parts] = {}
        for file, name, tensor in tensors:
            module, _, suffix = name.rpartition(".")
            if not module or not self.is_part(suffix, tensor):
                yield file, name, tensor
                continue
            parts = pending.setdefault(module, Parts(file))
            parts.tensors[suffix] = tensor
            if self.complete(parts.tensors):
                del pending[module]
                try:
                    weight = self.convert(module, parts.tensors)
                except ValueError as exc:
                    raise ModelLoadError(f"layer {module!r} of this {self.quant_method} checkpoint ({file}) cannot be "
                                         f"read: {exc}") from exc
                yield parts.file, f"{module}.weight", weight
        if pending:
            module, parts = next(iter(pending.items()))
            raise ModelLoadError(
                f"{len(pending)} layer(s) of this {self.quant_method} checkpoint lack some of their tensors, e.g. "
                f"{module!r} has only {sorted(parts.tensors)}; the checkpoint is incomplete: download it again")

    def linear_method(self) -> LinearMethod:
        return PrequantizedLinearMethod()


def _rows(t: torch.Tensor, out_rows: int) -> torch.Tensor:
    """A per-row scale as [N] float32 (a per-tensor scale repeated)."""
    t = t.to(torch.float32).reshape(-1)
    return t.expand(out_rows).clone() if t.numel() == 1 else t


class PrequantizedLinearMethod(LinearMethod):
    """Linear layers hold a QuantizedWeight's tensors as buffers (layer.kind says which); `weight` is an empty
    placeholder the loader finds, replaced by a dense weight for a layer stored unquantized."""

    keeps_experts = True  # an MoE's experts as stored, a 2-D layer each (one rank; else refused, as before)

    def __init__(self):
        self.dense = DenseLinearMethod()

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        if layer.role != "linear":
            return self.dense.create_weights(layer, input_size, output_size, dtype)
        layer.register_parameter("weight", nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False))
        layer.kind, layer.act, layer.compute_dtype, layer.filled = None, None, dtype, 0

    # ------------------------------------------------------------------------------------- loading
    def _start(self, layer: nn.Module, param: torch.Tensor, w: Any) -> None:
        """Allocate the layer's buffers for all its rows (a fused layer's parts each fill some)."""
        n, k, dev = layer.output_size, layer.input_size, param.device
        if not isinstance(w, QuantizedWeight):
            param.data = torch.empty(n, k, dtype=layer.compute_dtype, device=dev)
            layer.kind, layer.act = "dense", None
            return
        t = w.tensors
        layer.kind, layer.act = w.kind, w.act
        if w.kind == "int4":
            groups = t["scales"].shape[1]
            bufs = {"qweight": torch.empty(n, k // 8, dtype=torch.int32, device=dev),
                    "scales": torch.empty(n, groups, dtype=t["scales"].dtype, device=dev)}
            if t.get("zeros") is not None:
                bufs["zeros"] = torch.empty(n, groups, dtype=torch.uint8, device=dev)
            layer.perm = None if t.get("perm") is None else t["perm"].to(dev)
        elif w.kind == "fp8_block":
            bn, bk = w.block
            bufs = {"qweight": torch.empty(n, k, dtype=t["qweight"].dtype, device=dev),
                    "scales": torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32, device=dev)}
            layer.block = w.block
        else:  # int8 / fp8: one scale per row
            bufs = {"qweight": torch.empty(n, k, dtype=t["qweight"].dtype, device=dev),
                    "scales": torch.empty(n, dtype=torch.float32, device=dev)}
        for name, buf in bufs.items():
            layer.register_buffer(name, buf, persistent=False)
        if "zeros" not in bufs:
            layer.zeros = None

    def load(self, layer: nn.Module, param: torch.Tensor, tensor: Any, out_offset: int, out_size: int) -> None:
        if layer.role != "linear":
            return self.dense.load(layer, param, tensor, out_offset, out_size)
        kind = tensor.kind if isinstance(tensor, QuantizedWeight) else "dense"
        if layer.kind is None:
            self._start(layer, param, tensor)
        if kind != layer.kind or (isinstance(tensor, QuantizedWeight) and tensor.act != layer.act):
            raise ModelLoadError(f"its parts are stored differently ({layer.kind} and {kind}); a fused layer "
                                 "(q/k/v, gate/up) needs one scheme for all its parts")
        rows = slice(out_offset, out_offset + out_size)
        if kind == "dense":
            self.dense.load(layer, param, tensor.to(layer.compute_dtype), out_offset, out_size)
        elif kind == "fp8_block":
            bn, _ = layer.block
            if out_offset % bn or (out_size % bn and out_offset + out_size != layer.output_size):
                raise ModelLoadError(f"its part of {out_size} rows at row {out_offset} does not align with the "
                                     f"{bn}-row scale blocks")
            layer.qweight[rows] = tensor.tensors["qweight"].to(param.device)
            scales = tensor.tensors["scales"].to(param.device, torch.float32)
            layer.scales[out_offset // bn:out_offset // bn + scales.shape[0]] = scales
        else:
            t = tensor.tensors
            layer.qweight[rows] = t["qweight"].to(param.device)
            layer.scales[rows] = (t["scales"] if kind == "int4" else _rows(t["scales"], out_size)).to(param.device)
            if kind == "int4":
                if layer.zeros is not None:
                    layer.zeros[rows] = t["zeros"].to(param.device)
                perm = t.get("perm")
                if (perm is None) != (layer.perm is None) or (perm is not None and not torch.equal(
                        perm.to(param.device), layer.perm)):
                    raise ModelLoadError("its fused parts have different activation orders (g_idx)")
        layer.filled += out_size

    def process_after_loading(self, layer: nn.Module) -> None:
        if layer.role != "linear":
            return
        layer.kernel = None if layer.kind == "dense" else quant_kernels.choose(layer)

    # ------------------------------------------------------------------------------------- applying
    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight [N, K] in `dtype`, in the checkpoint's column order (the reference path)."""
        if layer.kind == "dense":
            return layer.weight.to(dtype)
        if layer.kind == "int4":
            w = int4.dequantize_int4(layer.qweight, layer.scales, layer.zeros, dtype)
            if layer.perm is not None:  # columns were sorted by group: put them back
                w = torch.empty_like(w).index_copy_(1, layer.perm, w)
            return w
        if layer.kind == "fp8_block":
            return fp8_kernels.dequantize_blocks(layer.qweight, layer.scales, layer.block, dtype)
        return fp8_kernels.dequantize_rows(layer.qweight, layer.scales, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.role != "linear":
            return self.dense.apply(layer, x, bias)
        if layer.kind == "dense":
            return F.linear(x, layer.weight, bias)
        if layer.kernel is not None:
            out = layer.kernel(layer, x)
            return out if bias is None else out + bias
        if layer.act is not None:  # the checkpoint's dynamic activation quantization, then its weights
            x = fake_quantize(x, *layer.act)
        return F.linear(x, self.dequantized(layer, x.dtype), bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return self.dense.embed(layer, ids)

