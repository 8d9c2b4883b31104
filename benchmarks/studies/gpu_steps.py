"""Where the bench workload's wall time goes, step by step: scheduling, building the step, the
runner's host work, waiting for the GPU, and the engine's bookkeeping after the tokens come back.

usage: python benchmarks/studies/gpu_steps.py [attention] [kv_cache] [overlap: 1|0]   (default flash triton 1)
Columns are host milliseconds per step in each part; "wait" is the host waiting for the GPU's tokens.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from nanoplug import LLM
from nanoplug.bench.throughput import workload, write_checkpoint

attention = sys.argv[1] if len(sys.argv) > 1 else "flash"
kv_cache = sys.argv[2] if len(sys.argv) > 2 else "triton"
overlap = (sys.argv[3] if len(sys.argv) > 3 else "1") == "1"
llm = LLM(str(write_checkpoint()), attention=attention, kv_cache=kv_cache, max_model_len=4096, overlap_steps=overlap)
llm.generate(["warm up"], use_tqdm=False)
core = llm.engine
runner = core.worker
clock: dict[str, float] = defaultdict(float)


def timed(obj, name, key):
    inner = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            clock[key] += time.perf_counter() - t
    setattr(obj, name, wrapper)


timed(core.scheduler, "schedule", "schedule")
timed(core.builder, "build", "build")
timed(runner, "launch", "launch")
timed(runner, "collect", "wait")
timed(core, "_apply", "resolve")


prompts, params = workload()
for i, (prompt, p) in enumerate(zip(prompts, params)):
    core.add_request(core.make_request(prompt, p, index=i, incremental_text=False))
rows = []
out_tokens = 0
torch.cuda.synchronize()
t_all = time.perf_counter()
while core.has_unfinished():
    before = dict(clock)
    t = time.perf_counter()
    out_tokens += sum(len(u.token_ids) for u in core.step())
    wall = time.perf_counter() - t
    is_prefill, tokens, n = core.last_step
    rows.append((is_prefill, n, wall, {k: clock[k] - before.get(k, 0.0) for k in clock}))
total = time.perf_counter() - t_all
print("prefill steps (ms):", " ".join(f"{1e3 * r[2]:.0f}" for r in rows if r[0]))
print(f"{attention}/{kv_cache} overlap={overlap}: {len(rows)} steps, {total:.2f} s, {out_tokens / total:,.0f} output tok/s")
buckets = [(0, 0, "prefill"), (1, 32, "decode 1-32"), (33, 128, "decode 33-128"), (129, 224, "decode 129-224"),
           (225, 256, "decode 225-256")]
keys = sorted({k for r in rows for k in r[3]})
print(f"{'steps':<16}{'n':>6}{'total s':>9}{'ms/step':>9}  " + "  ".join(f"{k}" for k in keys))
for lo, hi, name in buckets:
    sel = [r for r in rows if (r[0] if name == "prefill" else (not r[0] and lo <= r[1] <= hi))]
    if not sel:
        continue
    tot = sum(r[2] for r in sel)
    parts = "  ".join(f"{1e3 * sum(r[3].get(k, 0) for r in sel) / len(sel):.2f}" for k in keys)
    print(f"{name:<16}{len(sel):>6}{tot:>9.2f}{1e3 * tot / len(sel):>9.2f}  {parts}")
