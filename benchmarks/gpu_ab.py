"""One engine, two figures: the bench workload's output tok/s and batch-1 decode ms/token.

Uses only the public API (`LLM`, `SamplingParams`, `generate`), so the same script measures any two
commits alternately in one lease: `PYTHONPATH=/path/to/other/tree python3 benchmarks/gpu_ab.py`.
Batch-1 decode: a fresh 512-token prompt (no prefix-cache hit) with 1 and with 257 new tokens; the
difference over 256 tokens is the per-token decode time.

usage: python3 benchmarks/gpu_ab.py LABEL [engine options as key=value ...]
"""
from __future__ import annotations

import random
import subprocess
import sys
import time

import torch

import nanoplug
from nanoplug import LLM, SamplingParams
from nanoplug.bench.throughput import workload, write_checkpoint


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", nanoplug.__path__[0], "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def batch1_decode(llm: LLM, rng: random.Random, context: int = 512, tokens: int = 256) -> tuple[float, float]:
    """(ms per decode token, ms to the first token) of a fresh `context`-token prompt alone: one prompt generated
    with 1 new token, another with 1 + `tokens`; the difference over `tokens` is the per-token decode time."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    a, b = ([rng.randint(0, 10000) for _ in range(context)] for _ in range(2))
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([a], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([b], SamplingParams(max_tokens=tokens + 1, **greedy), use_tqdm=False)
    whole = time.perf_counter() - t
    return (whole - first) / tokens * 1e3, first * 1e3


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    options = dict(attention="flash", kv_cache="triton", max_model_len=4096)
    options.update({k: _value(v) for k, v in (a.split("=", 1) for a in sys.argv[2:])})
    t0 = time.perf_counter()
    llm = LLM(str(write_checkpoint()), **options)
    startup = time.perf_counter() - t0
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    prompts, params = workload()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    bench_s = time.perf_counter() - t
    out_tokens = sum(len(o.token_ids) for o in outs)
    rng = random.Random(1)
    decode = [batch1_decode(llm, rng)[0] for _ in range(3)]
    llm.close()
    print(f"RESULT {label} commit={_commit()} startup={startup:.1f}s bench={out_tokens / bench_s:,.0f} tok/s "
          f"({bench_s:.2f} s) batch1_decode={min(decode):.3f} ms/token (runs {', '.join(f'{d:.3f}' for d in decode)})")


if __name__ == "__main__":
    main()
