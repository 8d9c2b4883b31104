"""Weight format `dense`: the platform's plain method, weights in the model's dtype. The default for a
plain checkpoint, and what `quantization=None` (or a quantized checkpoint no format here can keep) gets:
the loader then dequantizes every tensor (gguf-py's values for a GGUF)."""
from __future__ import annotations

from nanoplug.api import WeightFormat


class DenseFormat(WeightFormat):
    description = "weights in the model's dtype, the platform's plain linear method (a quantized checkpoint dequantized)"
