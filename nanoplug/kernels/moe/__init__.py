"""Mixture-of-experts kernels: the grouped GEMM of `fused_moe.py` (Triton, CUDA) and its tuned block sizes."""
