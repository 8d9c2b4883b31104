"""Platform `cpu`: what is specific to running steps on the host's cores.

- the KV cache is sized by `cpu.kv_cache_gb` (no memory profiling: the host's memory is the model's);
- float32 steps use nanoplug's C++ kernels (`kernels/`, built once per machine): the fused RMSNorm,
  SiLU-and-mul and RoPE go into the model, the sampler takes their greedy argmax, and linear layers
  pack their weights once for a decode-sized GEMM (`packed_linear.py`, the dense linear method here);
- decode steps are recorded once per batch size and replayed (`graphs.py`, `cpu.graphs`), where the
  decode attention backend allows it; a recording that fails leaves them eager (the worker records
  why), or stops start-up with `cpu.require_graphs`;
- steps run one after another by default: the host computes the step itself, so there is nothing to
  overlap with;
- where the faster way depends on the CPU (packing float32 weights; a GGUF model's activations, float32
  or int8x2, by rows) it is measured once per machine and cached (`kernels/cpu/choices.py`), logged at
  start-up and shown by `nanoplug plugins`; an explicit option wins.
"""
from __future__ import annotations

import torch

from nanoplug.api import GraphCaptureError, LinearMethod, Platform, Target
from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.kernels.cpu import choices, sampling
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
        self.record_ahead = options.record_ahead
        # float32 CPU steps' C++ kernels (None where they are off or do not build here; why is logged)
        self.kernels = cpu_kernels.usable(options.kernels, target.dtype, target.device)
        self.gguf_activations = options.gguf_activations
        self.choices: list[str] = []  # what was chosen for this CPU and why, for the start-up log
        packing = options.weight_packing
        if packing is None and self.kernels is not None:  # nanoplug's GEMM or F.linear: measured
            answer, source = choices.choice("weight_packing", lambda: choices.measure_packing(self.kernels))
            self.choices.append(choices.describe("weight_packing", answer, source))
            packing = None if answer["weight_packing"] else False  # None: still only where it fits in memory
        elif options.weight_packing is not None:
            self.choices.append(f"weight_packing={options.weight_packing} (cpu option)")
        self.method = PackedLinearMethod(packing, target.dtype, target.device, self.kernels)

    def linear_method(self) -> LinearMethod:
        return self.method

    def greedy_sampler(self):
        return self.kernels.argmax if self.kernels is not None else None

    def temperature_sampler(self):
        """One uniform number a row instead of an exponential one per logit (sampling.py)."""
        return sampling.sample

    def grammar_sampler(self):
        """A temperature-only batch under grammars masked in its weights' buffer and drawn (sampling.py)."""
        return sampling.sample_masked

    def grammar_masker(self):
        """A grammar's bitmask added to a copy of the logits from the byte table (sampling.py)."""
        return sampling.mask

    def inverse_cdf_sampler(self):
        """Seeded and filtered rows too draw one uniform number a row (sampling.py)."""
        return sampling.draw

    def num_kv_blocks(self, block_bytes, profile, release) -> int:
        return max(int(self.kv_cache_gb * 2**30 // block_bytes), 1)

    @classmethod
    def notes(cls, target: Target) -> list[str]:
        known = choices.cached()
        if not known:
            return ["choices for this CPU (weight packing, GGUF activations): not measured yet; the first engine "
                    f"measures and caches them in {choices.path()}"]
        return [choices.describe(name, answer, f"measured here, cached in {choices.path().name}")
                for name, answer in sorted(known.items())]

    def _set_gguf_activations(self, model: torch.nn.Module) -> None:
        """The GGUF layers' activations: the explicit option, or the faster by rows as measured on this CPU."""
        from nanoplug.kernels.gguf.cpu_linear import Activations, GGUFLinearMethod

        methods = {id(m.linear_method): m.linear_method for m in model.modules()
                   if isinstance(getattr(m, "linear_method", None), GGUFLinearMethod)}
        if not methods:
            return
        if self.gguf_activations != "auto":
            acts = Activations(self.gguf_activations, 0, self.gguf_activations)
            self.choices.append(f"gguf_activations={self.gguf_activations} (cpu option)")
        else:
            quant = next(iter(methods.values())).kernels
            answer, source = choices.choice("gguf_activations", lambda: choices.measure_gguf_activations(quant))
            acts = Activations(answer["small"], answer["switch_rows"], answer["large"], measured=True)
            self.choices.append(choices.describe("gguf_activations", answer, source))
        for method in methods.values():
            method.set_activations(acts)

    def prepare_model(self, model: torch.nn.Module) -> None:
        self.method.log_summary()
        self._set_gguf_activations(model)
        if self.choices:
            cpu_kernels.log.info("cpu: for this CPU: %s", "; ".join(self.choices))
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
        # ahead where every rank must record in step, or a failure must stop start-up
        lazy = not (self.record_ahead or self.require_graphs) and self.target.tensor_parallel_size == 1
        graphs = CpuDecodeGraphs(forward, ctx, limits, scratch_block, lazy=lazy)
        try:
            graphs.capture()
        except CaptureError as exc:
            raise GraphCaptureError(f"cpu: decode steps cannot be recorded: {exc}; cpu={{'graphs': False}} runs them "
                                    "eager without trying") from exc
        cpu_kernels.log.info("cpu: decode steps of batch sizes %s recorded %s", ", ".join(map(str, graphs.sizes)),
                             "each when first needed" if lazy else "at start-up")
        return graphs
