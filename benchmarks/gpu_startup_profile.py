"""Where a warm `LLM(...)` start-up goes: run it once to fill the caches, then this in a fresh process.

usage: python benchmarks/gpu_startup_profile.py [--attention flash] [--kv-cache triton]
Prints the engine's start-up line and cProfile's top functions by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import time

from nanoplug import LLM
from nanoplug.bench import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="flash")
    parser.add_argument("--kv-cache", default="triton")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)6d %(message)s")
    path = str(write_checkpoint())
    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.enable()
    llm = LLM(path, attention=args.attention, kv_cache=args.kv_cache, max_model_len=4096)
    profiler.disable()
    print(f"LLM(...) {time.perf_counter() - t:.1f} s under the profiler")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(60)
    llm.close()


if __name__ == "__main__":
    main()
