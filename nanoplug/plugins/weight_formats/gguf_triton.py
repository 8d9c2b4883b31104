"""Weight format `gguf_triton`: a GGUF checkpoint's Q4_0/Q4_1/Q8_0/Q4_K weights kept quantized on the GPU
and multiplied by Triton kernels (kernels/gguf/triton_linear.py). What `quantization="auto"` keeps a GGUF
in on CUDA; by name it also runs on a CPU under TRITON_INTERPRET=1, for the tests."""
from __future__ import annotations

from nanoplug.api import LinearMethod, Target, WeightFormat
from nanoplug.kernels.gguf.blocks import FORMATS
from nanoplug.kernels.gguf.triton_linear import TritonGGUFLinearMethod, triton_reasons


class GGUFTritonFormat(WeightFormat):
    description = "a GGUF checkpoint's Q4_0/Q4_1/Q8_0/Q4_K weights kept in their blocks (Triton kernels, GPU)"
    priority = 5
    quant_method = "gguf"
    kept_types = frozenset(FORMATS)

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        return triton_reasons(target)

    def linear_method(self) -> LinearMethod:
        return TritonGGUFLinearMethod()
