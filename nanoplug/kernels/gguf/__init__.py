"""GGUF blocks repacked for Triton, and the Triton dequantize and GEMV kernels over them."""
