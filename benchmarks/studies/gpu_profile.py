"""Where a decode step of the bench workload goes on the GPU machine: wall time per step against
GPU kernel time per step (the rest is host work and launch gaps), and the top kernels.

usage: python benchmarks/studies/gpu_profile.py [attention]   (default flash)
"""
from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanoplug import LLM
from nanoplug.bench.throughput import workload, write_checkpoint

attention = sys.argv[1] if len(sys.argv) > 1 else "flash"
llm = LLM(str(write_checkpoint()), attention=attention, kv_cache="triton", max_model_len=4096)
prompts, params = workload()
core = llm.engine  # the engine core's own API: add requests, then step
for i, (prompt, p) in enumerate(zip(prompts, params)):
    core.add_request(core.make_request(prompt, p, index=i, incremental_text=False))
core.step()  # takes the requests in
while core.scheduler.waiting or any(s.is_prefilling for s in core.scheduler.running):
    core.step()
for _ in range(20):  # warm decode
    core.step()
torch.cuda.synchronize()
steps = 50
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps
events = prof.key_averages()
gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / steps
print(f"decode, batch {len(llm.engine.scheduler.running)}: wall {wall * 1e3:.2f} ms/step, GPU kernels {gpu_us / 1e3:.2f} ms/step")
print(events.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
