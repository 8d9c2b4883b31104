"""SiLU-and-mul on CUDA (nanoplug/kernels/cuda/fused_ops.py) against torch's `F.silu(gate) * up`: bit equality and
microseconds per call in a CUDA graph, from batch-1 decode rows to a prefill's. On the GPU machine, from the
repository root: `python3 benchmarks/studies/gpu_silu.py`."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: gpu_gguf's timer
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from gpu_gguf import _time_us  # noqa: E402

from nanoplug.kernels.cuda import fused_ops as K  # noqa: E402

for rows, width in ((1, 24576), (1, 6144), (256, 6144), (2048, 6144)):
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    d = width // 2
    eq = torch.equal(K.silu_and_mul(x), F.silu(x[:, :d]) * x[:, d:])
    print(f"rows {rows} width {width}: equal to F.silu * up: {eq}; {_time_us(lambda: K.silu_and_mul(x)):.2f} us "
          f"(torch {_time_us(lambda: F.silu(x[:, :d]) * x[:, d:]):.2f} us)", flush=True)
