"""Weight format `gguf`: a GGUF checkpoint's quantized weights kept in their blocks, on the CPU: Q4_0, Q4_1,
Q5_0, Q8_0, Q4_K (repacked into panels; Q5_0 as the Q8_0 panels of the same values beside a Q8_0 part of its layer
and where the panels have no SIMD Q5_0 path) and Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS, Q5_1, IQ4_NL (as in the file).

Chosen for a checkpoint whose config names it (`quantization_config.quant_method == "gguf"`, as the folders
`LLM("file.gguf")` and the default model load from have): the loader hands each tensor of these types to
the layers as it is in the file, and `kernels/gguf/cpu_linear.py` packs and multiplies them. A dequantized
row equals gguf-py's exactly. Tensors of other types arrive dequantized (the F32 norms; an F16 or IQ2
weight). Where this cannot serve (a CPU engine in bfloat16, several ranks), `quantization="auto"` takes
`gguf_triton` on CUDA, else dequantizes, and says why.
"""
from __future__ import annotations

import torch

from nanoplug.api import LinearMethod, Target, WeightFormat
from nanoplug.kernels.gguf.cpu_linear import FORMATS, cpu_method


class GGUFFormat(WeightFormat):
    description = ("a GGUF checkpoint's Q2_K..Q8_0, IQ4_XS and IQ4_NL weights kept in their blocks (C++ kernels, "
                   "CPU)")
    priority = 10  # over gguf_triton where both serve (a CPU under TRITON_INTERPRET=1)
    quant_method = "gguf"
    kept_types = FORMATS

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = []
        if target.device.type != "cpu":
            reasons.append(f"its C++ kernels run on the CPU, not {target.device.type} (on CUDA: quantization="
                           "'gguf_triton'; quantization=None dequantizes)")
        if target.dtype != torch.float32:
            reasons.append(f"it computes in float32, not {str(target.dtype).removeprefix('torch.')} (pass dtype='float32')")
        if target.tensor_parallel_size != 1:
            reasons.append("it serves one rank (tensor_parallel_size=1)")
        if not reasons:
            from nanoplug.kernels.cpu import kquant_ops, quant_ops

            why = quant_ops.unavailable() or kquant_ops.unavailable()
            if why:
                reasons.append(f"its C++ kernels cannot be built here: {why}")
        return reasons

    def linear_method(self) -> LinearMethod:
        return cpu_method()
