"""Where the time to first token and a batch-1 decode step go (issue 16 item 2): per engine step, its wall
time; then a torch profile of one fresh 512-token request (top CPU ops and CUDA kernels).

usage: python benchmarks/studies/gpu_latency_profile.py [--attention flash] [--kv-cache triton] [--trace FILE]
           [--model DIR]  (default: the bench's random Qwen3-0.6B shape)
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanoplug import SamplingParams
from nanoplug.bench.throughput import open_engine
from nanoplug.bench.latency import FreshPrompts


def timed_steps(core, prompt, params):
    """(wall ms of each engine.step, whether it brought a token) for one request sent alone."""
    start = time.perf_counter()
    core.add_request(core.make_request(prompt, params))
    steps = []
    while core.has_unfinished():
        t = time.perf_counter()
        updates = core.step()
        steps.append(((time.perf_counter() - t) * 1e3, (time.perf_counter() - start) * 1e3,
                      sum(len(u.token_ids) for u in updates)))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="flash")
    parser.add_argument("--kv-cache", default="triton")
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the profiled request here")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the bench's)")
    args = parser.parse_args()
    llm, startup = open_engine(args.model, attention=args.attention, kv_cache=args.kv_cache)
    core = llm.engine
    fresh = FreshPrompts(core.facts.vocab_size)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16)
    for p in fresh.take(3, 512):  # warm
        timed_steps(core, p, params)
    for p in fresh.take(2, 512):
        steps = timed_steps(core, p, params)
        print("TTFT request, per step (step wall ms, ms since sent, tokens):",
              " ".join(f"{w:.2f}/{s:.2f}/{n}" for w, s, n in steps[:6]), "...")
    torch.cuda.synchronize()
    (p,) = fresh.take(1, 512)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = timed_steps(core, p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2))
        torch.cuda.synchronize()
    print("profiled request:", " ".join(f"{w:.2f}/{s:.2f}/{n}" for w, s, n in steps))
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"GPU kernel time of the profiled request: {gpu_us / 1e3:.2f} ms")
    print(events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    (p,) = fresh.take(1, 128)
    steps = timed_steps(core, p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64))
    walls = sorted(w for w, _, _ in steps[4:])
    print(f"batch-1 decode: step wall median {walls[len(walls) // 2]:.3f} ms, min {walls[0]:.3f}; "
          f"ms/token {(steps[-1][1] - steps[3][1]) / (len(steps) - 4):.3f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (p,) = fresh.take(1, 128)
        steps = timed_steps(core, p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=24))
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    llm.close()


if __name__ == "__main__":
    main()
