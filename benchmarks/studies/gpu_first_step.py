"""What the host does in the bench workload's first steps (after start-up and the warm-up request):
a cProfile of them, to catch kernels compiled on first use inside the timed run.

usage: python benchmarks/studies/gpu_first_step.py [attention]   (default flash)
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from nanoplug import LLM, SamplingParams
from nanoplug.bench.throughput import workload, write_checkpoint

llm = LLM(str(write_checkpoint()), attention=sys.argv[1] if len(sys.argv) > 1 else "flash", kv_cache="triton",
          max_model_len=4096)
llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
prompts, params = workload()
core = llm.engine  # the engine core's own API: add requests, then step
for i, (prompt, p) in enumerate(zip(prompts, params)):
    core.add_request(core.make_request(prompt, p, index=i, incremental_text=False))
prof = cProfile.Profile()
for i in range(4):
    t = time.perf_counter()
    prof.enable()
    core.step()
    torch.cuda.synchronize()
    prof.disable()
    print(f"step {i}: {1e3 * (time.perf_counter() - t):.0f} ms, last resolved {core.last_step}")
pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
