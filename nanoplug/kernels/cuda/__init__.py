"""Triton kernels for NVIDIA GPUs: the fused small ops, temperature sampling, batch-1/2 GEMV."""
