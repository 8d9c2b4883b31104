"""Platform `cpu`: what is specific to running steps on the host's cores.

- the KV cache is sized by `cpu.kv_cache_gb` (no memory profiling: the host's memory is the model's);
- float32 steps use nanoplug's C++ kernels (`kernels/`, built once per machine): the fused RMSNorm,
  SiLU-and-mul and RoPE go into the model, the sampler takes their greedy argmax, and linear layers
  pack their weights once for a decode-sized GEMM (`packed_linear.py`, the dense linear method here);
- decode steps are recorded once per batch size and replayed (`graphs.py`, `cpu.graphs`), where the
  decode attention backend allows it; a recording that fails leaves them eager (the worker records
  why), or stops start-up with `cpu.require_graphs`;
- steps run one after another by default: the host computes the step itself, so there is nothing to
  overlap with.
"""
from __future__ import annotations

import torch

from nanoplug.api import GraphCaptureError, LinearMethod, Platform, Target
from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.kernels.cpu import sampling
from nanoplug.plugins.platforms.cpu.options import CpuOptions
from nanoplug.plugins.platforms.cpu.graphs import CaptureError, CpuDecodeGraphs
from nanoplug.plugins.platforms.cpu.packed_linear import PackedLinearMethod


class CpuPlatform(Platform):
    description = "the host's cores: C++ kernels and packed weights for float32, KV cache sized by cpu.kv_cache_gb"
    priority = 0
    device_type = "cpu"
    Options = CpuOptions

    def __init__(self, options: CpuOptions, target: Target):
        super().__init__(options, target)
        self.kv_cache_gb = options.kv_cache_gb
        self.graphs = options.graphs
        self.require_graphs = options.require_graphs
        # float32 CPU steps' C++ kernels (None where they are off or do not build here; why is logged)
        self.kernels = cpu_kernels.usable(options.kernels, target.dtype, target.device)
        self.method = PackedLinearMethod(options.weight_packing, target.dtype, target.device, self.kernels)

    def linear_method(self) -> LinearMethod:
        return self.method

    def greedy_sampler(self):
        return self.kernels.argmax if self.kernels is not None else None

    def temperature_sampler(self):
        """One uniform number a row instead of an exponential one per logit (sampling.py)."""
        return sampling.sample

    def num_kv_blocks(self, block_bytes, profile, release) -> int:
        return max(int(self.kv_cache_gb * 2**30 // block_bytes), 1)

    def prepare_model(self, model: torch.nn.Module) -> None:
        self.method.log_summary()
        if self.kernels is None:
            return
        if model.install_fused_ops(cpu_kernels.fused_ops(self.kernels)):
            cpu_kernels.log.info("cpu_kernels: fused RMSNorm, SiLU-and-mul and RoPE kernels installed in the model")
        else:
            cpu_kernels.log.info("cpu_kernels: the model has no layer that takes fused ops; it runs its own "
                                 "RMSNorm, SiLU and RoPE")

    def capture_graphs(self, forward, ctx, limits, scratch_block, prefill_forward=None):
        if self.kernels is None and self.graphs and self.require_graphs:
            raise GraphCaptureError("cpu: decode steps are recorded only with the C++ kernels, and they are off here "
                                    "(float32 only, and a C++ compiler; the log says why); use dtype='float32' "
                                    "where a compiler is found")
        if self.kernels is None or not self.graphs:
            return None
        graphs = CpuDecodeGraphs(forward, ctx, limits, scratch_block)
        try:
            graphs.capture()
        except CaptureError as exc:
            raise GraphCaptureError(f"cpu: decode steps cannot be recorded: {exc}; cpu={{'graphs': False}} runs them "
                                    "eager without trying") from exc
        cpu_kernels.log.info("cpu: decode steps recorded for batch sizes %s", ", ".join(map(str, graphs.graphs)))
        return graphs
