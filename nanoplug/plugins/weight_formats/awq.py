"""Weight format `awq`: AWQ checkpoints (`quant_method: "awq"`, AutoAWQ's GEMM packing): 4-bit `qweight` and
`qzeros` packed along the output in AWQ's interleaved order, `scales`, kept quantized in
kernels/quant/int4.py's layout (Triton W4A16 on CUDA)."""
from __future__ import annotations

import torch

from nanoplug.kernels.quant import int4
from nanoplug.plugins.weight_formats.prequantized import PrequantizedFormat, QuantizedWeight


class AWQFormat(PrequantizedFormat):
    description = ("AWQ 4-bit checkpoints (GEMM packing: qweight/qzeros/scales), kept quantized (Triton W4A16 on CUDA, "
                   "C++ int4 on CPU)")
    quant_method = "awq"
    suffixes = ("qweight", "qzeros", "scales")

    def refuses(self) -> str | None:
        q = self.qconfig
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            return f"its weights have {bits} bits; nanoplug keeps 4-bit AWQ only"
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            return f"its {version!r} packing is not served (AutoAWQ's 'gemm' is, as in vLLM)"
        if not q.get("zero_point", True):
            return "it has no zero points (zero_point: false), which nanoplug's AWQ path does not serve"
        return None

    def complete(self, parts: dict[str, torch.Tensor]) -> bool:
        return {"qweight", "qzeros", "scales"} <= parts.keys()

    def convert(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, scales, zeros = int4.from_awq(parts["qweight"], parts["qzeros"], parts["scales"])
        return QuantizedWeight("int4", torch.Size((qweight.shape[0], qweight.shape[1] * 8)),
                               {"qweight": qweight, "scales": scales, "zeros": zeros, "perm": None})
