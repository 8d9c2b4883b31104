"""Platform `cuda`: what is specific to NVIDIA GPUs.

- the KV cache takes what is left of `cuda.memory_utilization` of the GPU's memory after the largest
  step has run once (memory profiling), and is allocated zeroed;
- the small ops of every layer are one Triton kernel each (`fused_kernels.py`; torch.compile'd where
  triton does not import), every kind of step runs once at start-up (kernels that compile on first use
  compile then), and decode and small fresh prefills run under CUDA graphs (`graphs.py`,
  `prefill_graphs.py`), unless `cuda.enforce_eager`; a failed capture leaves them eager (the worker
  records why), or stops start-up with `cuda.require_graphs`;
- linear layers take one- and two-row products (batch-1 and batch-2 decode) by a Triton kernel
  (`small_gemm.py`), and batches sampled at a temperature alone draw their tokens in one Triton pass over
  the logits (`sampling_kernel.py`), unless `cuda.enforce_eager` or `cuda.compile_fused_ops=False`;
- steps overlap by default: the host prepares step N+1 while the GPU computes step N, and sampled
  tokens come back by a non-blocking copy the next step waits for.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import os

import torch

from nanoplug.api import (FusedOps, GraphCaptureError, Platform, ProcessGroup, SamplingBatch, StepBatch, StepLimits,
                          Target, add_rms_norm, apply_rope, rms_norm, silu_and_mul)
from nanoplug.api.disk_cache import cache_root
from nanoplug.kernels.cuda import bitmask as bitmask_kernel, fused_ops as fused_kernels, sampling as sampling_kernel, \
    small_gemm
from nanoplug.kernels.moe import fused_moe, routing as moe_routing
from nanoplug.plugins.platforms.cuda.graphs import DecodeGraphs
from nanoplug.plugins.platforms.cuda.options import CudaOptions
from nanoplug.plugins.platforms.cuda.prefill_graphs import CudaPrefillGraphs


def persist_triton_kernels() -> None:
    """Triton keeps every kernel it compiles on disk, keyed by its source, the Triton version and the GPU
    target, so a later process loads instead of compiling; the folder goes under nanoplug's cache (with
    FlashAttention-4's), where one place holds what nanoplug builds per machine. A setting of the user's wins."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_root() / "triton"))


class CudaPlatform(Platform):
    description = "NVIDIA GPUs: memory-sized KV cache, CUDA graphs, Triton fused ops, overlapped steps"
    priority = 100
    device_type = "cuda"
    Options = CudaOptions

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = super().unavailable(target)
        if not reasons and not torch.cuda.is_available():
            reasons.append("torch sees no CUDA GPU (a CPU build of torch, or no driver); use device='cpu'")
        return reasons

    @classmethod
    def default_dtype(cls, saved: torch.dtype | None) -> torch.dtype:
        return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16

    @classmethod
    def overlaps_by_default(cls) -> bool:
        return True

    def __init__(self, options: CudaOptions, target: Target):
        super().__init__(options, target)
        persist_triton_kernels()  # before any plugin's kernel compiles (they do in warm-up)
        self.memory_utilization = options.memory_utilization
        self.enforce_eager = options.enforce_eager
        self.compile_fused_ops = options.compile_fused_ops
        self.require_graphs = options.require_graphs

    def worker_device(self, device: torch.device, group: ProcessGroup) -> torch.device:
        if group.world_size > 1:
            device = torch.device("cuda", group.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        return device

    # ----------------------------------------------------------------------------- KV cache
    def num_kv_blocks(self, block_bytes, profile, release) -> int:
        """Run the largest prefill once on a small temporary cache, then give the rest to the KV cache."""
        device = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        release()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # everything in use now counts, this process's included (memory it reserved but cannot release,
        # such as a closed engine's graph pools, is no more ours to give than another process's); the
        # profile's activations come on top of the weights allocated now
        in_use = total - free
        budget = total * self.memory_utilization - in_use - (peak - torch.cuda.memory_allocated(device))
        num_blocks = int(budget // block_bytes)
        if num_blocks < 1:
            gib = 2 ** 30
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {in_use / gib:.1f} of {total / gib:.1f} GiB are in use "
                f"({torch.cuda.memory_reserved(device) / gib:.1f} GiB by this process) and the largest step needs "
                f"{(peak - torch.cuda.memory_allocated(device)) / gib:.1f} GiB more; close other engines "
                "(LLM.close()), raise cuda={'memory_utilization': ...} or lower max_num_batched_tokens")
        return num_blocks

    # zeros, not empty: kernels that load whole pages (FlashAttention-4 by TMA) read the unused rows of a
    # sequence's last page, and NaN garbage there would turn into NaN outputs (0 * NaN); one memset at start-up
    # then spares the step loop clearing each block before its first use
    kv_cache_zeroed = True

    def allocate_kv_cache(self, shape, dtype, device) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    # ---------------------------------------------------------------------- model and steps
    def _uses(self, kernels) -> bool:
        """Whether a module of our Triton kernels serves this engine: not eager, fused ops on, triton importable."""
        return not self.enforce_eager and self.compile_fused_ops and kernels.triton is not None

    def linear_method(self):
        if not self._uses(small_gemm):
            return super().linear_method()
        # a verification's rows through the one-row kernel: greedy drafts give the plain engine's tokens in bf16
        return small_gemm.SmallBatchLinearMethod(small_gemm.verify_rows(self.target.decode_query_len))

    def temperature_sampler(self):
        """Temperature-only batches (the usual chat and bench request) drawn in one pass over the logits."""
        return sampling_kernel.sample if self._uses(sampling_kernel) else None

    def grammar_sampler(self):
        """A temperature-only batch under grammars masked and drawn in the one pass (no masked copy, one launch)."""
        return sampling_kernel.sample_masked if self._uses(sampling_kernel) else None

    def grammar_masker(self):
        """A grammar's bitmask applied in one launch, not unpacked by a dozen (structured outputs at batch 64)."""
        return bitmask_kernel.apply_bitmask if self._uses(bitmask_kernel) else None

    def prepare_model(self, model: torch.nn.Module) -> None:
        """One kernel for each small op (add + RMSNorm, SiLU-and-mul, RoPE): on a GPU each eager op is
        several launches and passes over memory. Our Triton kernels where triton imports (plain launches:
        no compiled region's guards per call, no Dynamo or Inductor at start-up), else torch.compile'd ops
        (dynamic shapes, one compile for every batch). CUDA graphs capture either."""
        if self.enforce_eager or not self.compile_fused_ops:
            return
        ops = fused_kernels.fused_ops()
        if ops is None:
            compile_ = functools.partial(torch.compile, dynamic=True, fullgraph=True)
            ops = FusedOps(compile_(rms_norm), compile_(add_rms_norm), compile_(silu_and_mul), compile_(apply_rope))
        if fused_moe.triton is not None:  # MoE experts: a launch per projection; the router: one launch
            moe = functools.partial(fused_moe.fused_experts, silu_and_mul=ops.silu_and_mul)
            ops = dataclasses.replace(ops, moe=moe, route=moe_routing.route)
        model.install_fused_ops(ops)

    def warm_up(self, run, limits: StepLimits, num_blocks: int) -> None:
        """Run each kind of step once on the first blocks: fresh prefills and prefill chunks over
        cached context, with short and long queries, and a decode, greedy and at a temperature. Kernels
        that compile on first use (FlashAttention-4 builds one per variant, seconds each, and a query
        longer than one tile is another variant) then compile here, not inside the first requests' steps.
        The blocks are cleared before the block manager first hands them out (`take_new_blocks`)."""
        bs = limits.block_size
        long = max(2, min(512, limits.max_model_len - 2, limits.max_num_batched_tokens))
        table = [min(i, num_blocks) for i in range((long + 1 + bs - 1) // bs)]
        greedy = SamplingBatch.greedy(1)
        warm = SamplingBatch([1.0], [0], [1.0], [0.0], [None], [0])  # the temperature sampler's kernel
        for is_prefill, start, n, sampling in ((True, 0, 2, greedy), (True, 0, long, greedy), (True, 1, 2, greedy),
                                               (True, 1, long, greedy), (False, 1, 1, greedy), (False, 1, 1, warm)):
            run(StepBatch(is_prefill=is_prefill, input_ids=[0] * n, starts=[start], query_lens=[n],
                          block_tables=[table], sample_rows=[0], sampling=sampling))
        torch.cuda.synchronize(self.device)

    def capture_graphs(self, forward, ctx, limits: StepLimits, scratch_block: int, prefill_forward=None):
        """Capture decode for batch-size buckets, and small fresh prefills for token-count buckets where
        the prefill backend can be captured. A backend whose kernels cannot be captured leaves decode
        eager (the worker logs and records why), never broken."""
        if self.enforce_eager:
            return None
        graphs = DecodeGraphs(forward, ctx, limits, scratch_block, self.device)
        try:
            graphs.capture()
            if prefill_forward is not None:
                prefill = CudaPrefillGraphs(prefill_forward, ctx, limits, scratch_block, self.device)
                if prefill.sizes and prefill.max_seqs:
                    prefill.capture(graphs.pool)
                    graphs.prefill = prefill
                    graphs.captures += len(prefill.graphs)
        except Exception as exc:  # any capture failure means: run eager (or stop, with require_graphs)
            torch.cuda.synchronize(self.device)
            raise GraphCaptureError(
                f"CUDA graph capture failed ({type(exc).__name__}: {exc}); a decode attention backend or op that "
                "cannot be captured is the usual cause: pick another attention backend, or set "
                "cuda={'enforce_eager': True} to run eager without trying") from exc
        return graphs

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def to_host(self, tokens, rows):
        tokens = tokens.to("cpu", non_blocking=True)
        rows = rows.to("cpu", non_blocking=True) if rows is not None else None
        done = torch.cuda.Event()
        done.record()
        return tokens, rows, done

    def wait(self, handle) -> None:
        handle.synchronize()

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        gc.collect()  # graphs, compiled ops and the model can sit in reference cycles
        torch.cuda.empty_cache()
