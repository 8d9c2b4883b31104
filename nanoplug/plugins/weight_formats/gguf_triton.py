"""Weight format `gguf_triton`: a GGUF checkpoint's quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, and Q2_K, Q3_K,
Q5_K, Q6_K, IQ4_XS, Q5_0, Q5_1, IQ4_NL in the file's own blocks) kept quantized on the GPU
and multiplied by Triton kernels (kernels/gguf/triton_linear.py). What `quantization="auto"` keeps a GGUF
in on CUDA; by name it also runs on a CPU under TRITON_INTERPRET=1, for the tests."""
from __future__ import annotations

from nanoplug.api import LinearMethod, Target, WeightFormat
from nanoplug.kernels.gguf.blocks import FORMATS
from nanoplug.kernels.gguf.triton_kquants import FORMATS as BLOCK_FORMATS
from nanoplug.kernels.gguf.triton_linear import TritonGGUFLinearMethod, triton_reasons


class GGUFTritonFormat(WeightFormat):
    description = ("a GGUF checkpoint's Q2_K..Q8_0, IQ4_XS and IQ4_NL weights kept in their blocks (Triton kernels, "
                   "GPU)")
    priority = 5
    quant_method = "gguf"
    kept_types = frozenset(FORMATS) | frozenset(BLOCK_FORMATS)

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        return triton_reasons(target)

    def linear_method(self) -> LinearMethod:
        return TritonGGUFLinearMethod()
