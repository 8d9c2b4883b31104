"""Kernels for pre-quantized checkpoints' weights: int4 groups (W4A16) and fp8 blocks, in torch (the
reference, and the CPU path) and in Triton (CUDA)."""
