"""Where an `LLM(...)` start-up goes: cProfile's top functions, every Triton compile (kernel, seconds, when) and
the FlashAttention-4 kernels built, with the fields of FA4's compile key in which they differ.

A warm start: run once to fill the caches, then this in a fresh process. A fresh machine's start:
`NANOPLUG_CACHE=$(mktemp -d) python benchmarks/studies/gpu_startup_profile.py` (every cache lives under that root).
usage: python benchmarks/studies/gpu_startup_profile.py [--attention flash] [--kv-cache triton]
"""
from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import time

import triton.runtime.jit as jit

from nanoplug import LLM
from nanoplug.bench.throughput import write_checkpoint

T0 = time.perf_counter()
compiles: list[tuple[float, str, float]] = []  # (seconds, kernel, seconds since start)


def _timed(compile_fn):
    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        out = compile_fn(self, *args, **kwargs)
        compiles.append((time.perf_counter() - t, getattr(self.fn, "__name__", "?"), t - T0))
        return out
    return timed


def fa4_kernels() -> None:
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except ImportError:
        return
    cache = _flash_attn_fwd.compile_cache
    keys = list(getattr(cache, "cache", cache).keys())
    print(f"FlashAttention-4 kernels built or loaded: {len(keys)}")
    for i in range(len(keys[0]) if keys else 0):
        values = [k[i] for k in keys]
        if any(v != values[0] for v in values):
            print(f"  compile-key field {i}: {values}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="flash")
    parser.add_argument("--kv-cache", default="triton")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)6d %(message)s")
    jit.JITFunction._do_compile = _timed(jit.JITFunction._do_compile)  # triton 3.x: each cache miss compiles here
    path = str(write_checkpoint())
    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.enable()
    llm = LLM(path, attention=args.attention, kv_cache=args.kv_cache, max_model_len=4096)
    profiler.disable()
    print(f"LLM(...) {time.perf_counter() - t:.1f} s under the profiler")
    print(f"Triton kernels compiled or loaded: {len(compiles)}, {sum(c[0] for c in compiles):.1f} s")
    for seconds, name, at in sorted(compiles, reverse=True):
        print(f"  {seconds:6.2f} s at {at:6.1f} s  {name}")
    fa4_kernels()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    llm.close()


if __name__ == "__main__":
    main()
