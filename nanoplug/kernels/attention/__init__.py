"""Attention kernels: paged decode (Triton, torch), varlen prefill over packed pages, float8 page gathers."""
