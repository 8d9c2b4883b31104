"""Weight format `gptq`: GPTQ checkpoints (`quant_method: "gptq"`, AutoGPTQ / GPTQModel / optimum): 4-bit
`qweight` packed along the input, `qzeros` along the output, `scales`, and with activation order (desc_act)
`g_idx`, kept quantized in kernels/quant/int4.py's layout (Triton W4A16 on CUDA)."""
from __future__ import annotations

import torch

from nanoplug.kernels.quant import int4
from nanoplug.plugins.weight_formats.prequantized import PrequantizedFormat, QuantizedWeight


class GPTQFormat(PrequantizedFormat):
    description = ("GPTQ 4-bit checkpoints (qweight/qzeros/scales/g_idx), kept quantized (Triton W4A16 on CUDA, C++ int4 "
                   "on CPU)")
    quant_method = "gptq"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def refuses(self) -> str | None:
        q = self.qconfig
        if q.get("bits") != 4:
            return f"its weights have {q.get('bits')} bits; nanoplug keeps 4-bit GPTQ only"
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            return f"its checkpoint_format {fmt!r} is not served (gptq and gptq_v2 are)"
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores each zero point less one
        self.desc_act = bool(q.get("desc_act"))
        return None

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix in self.suffixes

    def complete(self, parts: dict[str, torch.Tensor]) -> bool:
        return {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.desc_act else set()) <= parts.keys()

    def regroup(self, tensors):
        # without desc_act a g_idx is the plain order (column // group), which vLLM ignores as well
        return super().regroup((f, n, t) for f, n, t in tensors if self.desc_act or not n.endswith(".g_idx"))

    def convert(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, scales, zeros = int4.from_gptq(parts["qweight"], parts["qzeros"], parts["scales"], self.zero_offset)
        n, k = qweight.shape[0], qweight.shape[1] * 8
        perm = int4.sort_by_group(parts["g_idx"], k // scales.shape[1]) if "g_idx" in parts else None
        if perm is not None:
            qweight = int4.pack_int4(int4.unpack_int4(qweight)[:, perm])
        return QuantizedWeight("int4", torch.Size((n, k)),
                               {"qweight": qweight, "scales": scales, "zeros": zeros, "perm": perm})
