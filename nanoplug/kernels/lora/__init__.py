"""Triton kernels for per-request LoRA (each token reads its own adapter's A and B)."""
