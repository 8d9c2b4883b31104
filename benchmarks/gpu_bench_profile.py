"""Where one run of the bench workload goes (issue 16 item 5): the GPU's busy fraction, and per engine step
the host's own time, the time it waits for the device, the GPU span of the step it launched and of its
sampler, and the host-device synchronizations; the GPU's time by kernel, and its idle time between kernels by
the pair of kernels around each gap (where it waits: inside graphs, at the step boundary, in the tail).

usage: python benchmarks/gpu_bench_profile.py [--attention flash] [--kv-cache triton] [--num-seqs 256]
           [--model DIR] [--device cuda]

The engine runs the workload once unprofiled (its wall time, as `nanoplug bench` measures it), then once
under torch.profiler with the worker's launch, sampler and wait marked (record_function), which adds host
time of its own: read the host figures as upper bounds and the GPU figures as they are. `--device cpu
--model DIR` runs the same analysis on a CPU (no GPU figures) to check the script itself.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from nanoplug import LLM, SamplingParams
from nanoplug.bench.throughput import workload, write_checkpoint

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")  # blocking calls


def marked(name_of, fn):
    """fn, run inside a profiler range named name_of(*args)."""
    def call(*args, **kwargs):
        with record_function(name_of(*args)):
            return fn(*args, **kwargs)
    return call


def mark_worker(llm) -> None:
    """Ranges around what a step does on the worker (the engine's own `single` worker: the runner itself)."""
    core = llm.engine
    runner = core.worker
    runner._launch = marked(lambda step, *a: f"launch {'prefill' if step.is_prefill else 'decode'}", runner._launch)
    sampler = runner.sampler
    runner.sampler = marked(lambda *a: "sample", sampler)
    runner.sampler.logprobs = sampler.logprobs
    runner.platform.wait = marked(lambda *a: "wait", runner.platform.wait)
    core.step = marked(lambda *a: "engine step", core.step)


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def kernel_table(kernels, top: int, launchers: dict) -> None:
    """The GPU's time by kernel name (graph replays included), largest first, with the host ops that launched
    a kernel outside a graph."""
    total, by_name = 0.0, {}
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        total += us
        name = e.name[:90]
        t, n = by_name.get(name, (0.0, 0))
        by_name[name] = (t + us, n + 1)
    print(f"kernels: {total / 1e6:.3f} s in all; the {top} largest:")
    print(f"{'s':>7} {'share':>6} {'calls':>8} {'us/call':>8}  kernel")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / 1e6:7.3f} {t / total:6.1%} {n:8d} {t / n:8.2f}  {name}")
        if name in launchers:
            print(f"{'':33}launched by {', '.join(f'{op} x{c}' for op, c in launchers[name].most_common(3))}")


def gap_table(kernels, top: int, window: tuple[float, float]) -> None:
    """Where the GPU waits: idle time between one kernel's end and the next one's start, summed by the pair of
    kernel names around it, largest first, with how it splits over the run's thirds."""
    third = (window[1] - window[0]) / 3
    by_pair, end, before, sizes = {}, None, None, collections.Counter()
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        start, stop = e.time_range.start, e.time_range.end
        if end is not None and start > end:
            gap = start - end
            pair = (before[:40], e.name[:40])
            t, n, parts = by_pair.get(pair, (0.0, 0, [0.0, 0.0, 0.0]))
            parts[min(int((start - window[0]) // third), 2)] += gap
            by_pair[pair] = (t + gap, n + 1, parts)
            sizes["< 5 us" if gap < 5 else "5-20 us" if gap < 20 else "20-100 us" if gap < 100 else ">= 100 us"] += gap
        if end is None or stop > end:
            end, before = stop, e.name
    total = sum(t for t, _, _ in by_pair.values())
    print(f"GPU idle between kernels: {total / 1e6:.3f} s; by gap size: "
          + ", ".join(f"{k} {v / 1e6:.3f} s" for k, v in sorted(sizes.items())))
    print(f"{'s':>7} {'gaps':>7} {'us/gap':>7} {'thirds (s)':>20}  kernel before -> kernel after")
    for (a, b), (t, n, parts) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        split = "/".join(f"{x / 1e6:.3f}" for x in parts)
        print(f"{t / 1e6:7.3f} {n:7d} {t / n:7.1f} {split:>20}  {a} -> {b}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="flash")
    parser.add_argument("--kv-cache", default="triton")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the bench checkpoint)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernels", type=int, default=25, help="rows of the table of GPU time by kernel")
    args = parser.parse_args()
    options = dict(attention=args.attention, kv_cache=args.kv_cache, max_model_len=4096, device=args.device)
    if args.device == "cpu":
        options.update(max_model_len=2048, dtype="float32")
    llm = LLM(str(args.model or write_checkpoint()), **options)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    prompts, params = workload(args.num_seqs, max_output_len=args.max_output_len)
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"unprofiled: {wall:.2f} s, {tokens / wall:,.0f} output tok/s")

    mark_worker(llm)
    cuda = args.device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        profiled = time.perf_counter() - t
    marks = {"engine step", "launch decode", "launch prefill", "wait", "sample"}
    # a range is recorded twice under CUDA: on the host, and as a GPU annotation spanning the kernels it launched
    # (graph replays included, which the host range's own device time misses); the annotation is no kernel
    spans = [e for e in prof.events() if e.name in marks and e.device_type == DeviceType.CUDA]
    events = [e for e in prof.events() if not (e.name in marks and e.device_type == DeviceType.CUDA)]
    steps = [e for e in events if e.name == "engine step"]
    launches = [e for e in events if e.name.startswith("launch ")]
    waits = [e for e in events if e.name == "wait"]
    syncs = [e for e in events if e.name in SYNCS]
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    window = (min(e.time_range.start for e in steps), max(e.time_range.end for e in steps))
    print(f"profiled: {profiled:.2f} s, {len(steps)} engine steps, {len(launches)} launches "
          f"({sum(e.name == 'launch prefill' for e in launches)} prefill)")

    def inside(e, s):
        return s.time_range.start <= e.time_range.start and e.time_range.end <= s.time_range.end

    rows = []
    for s in steps:
        wait = sum(w.cpu_time_total for w in waits if inside(w, s))
        rows.append((s.cpu_time_total, wait, sum(1 for e in syncs if inside(e, s))))
    print(f"engine step, median: wall {median(r[0] for r in rows) / 1e3:.3f} ms, waiting for the device "
          f"{median(r[1] for r in rows) / 1e3:.3f} ms, host's own {median(r[0] - r[1] for r in rows) / 1e3:.3f} ms; "
          f"host-device syncs per step {sum(r[2] for r in rows) / max(len(rows), 1):.2f}")
    if cuda:
        busy = union_us(kernels) / (window[1] - window[0])
        def span(e):
            return e.time_range.end - e.time_range.start

        for kind in ("decode", "prefill"):
            own = [span(e) for e in spans if e.name == f"launch {kind}"]
            print(f"launch {kind}: {len(own)} steps, GPU span per step median {median(own) / 1e3:.3f} ms, "
                  f"total {sum(own) / 1e6:.2f} s")
        drawn = [span(e) for e in spans if e.name == "sample"]
        print(f"sampler: GPU span per step median {median(drawn) / 1e3:.3f} ms, total {sum(drawn) / 1e6:.2f} s")
        print(f"GPU busy {busy:.1%} of the {(window[1] - window[0]) / 1e6:.2f} s from the first step to the last")
        thirds = [(window[0] + i * (window[1] - window[0]) / 3, window[0] + (i + 1) * (window[1] - window[0]) / 3)
                  for i in range(3)]
        for i, (a, b) in enumerate(thirds):  # the batch shrinks over the run: the last third is its tail
            clipped = [(max(s, a), min(e, b)) for s, e in kernels if e > a and s < b]
            print(f"  third {i + 1} of the run: GPU busy {union_us(clipped) / (b - a):.1%}")
        launchers: dict = {}
        for e in events:
            if e.device_type == DeviceType.CPU:
                for k in getattr(e, "kernels", []):
                    launchers.setdefault(k.name[:90], collections.Counter())[e.name] += 1
        on_gpu = [e for e in events if e.device_type == DeviceType.CUDA]
        kernel_table(on_gpu, args.kernels, launchers)
        gap_table([e for e in on_gpu if window[0] <= e.time_range.start <= window[1]], args.kernels, window)
    llm.close()


if __name__ == "__main__":
    main()
