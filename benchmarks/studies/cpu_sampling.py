"""The default model on this CPU, sampled at a temperature: output tok/s at batch 1 and 32 with the cpu
platform's temperature sampler (one uniform number a row) and with the plain sampler (an exponential number
per logit), each in its own process.

usage: python benchmarks/studies/cpu_sampling.py [plain|platform]   (no argument: both, one after the other)
"""
from __future__ import annotations

import subprocess
import sys
import time


def run(mode: str) -> None:
    from nanoplug import LLM, SamplingParams
    from nanoplug.checkpoint.default_model import default_model_path
    from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

    if mode == "plain":
        CpuPlatform.temperature_sampler = lambda self: None
    llm = LLM(str(default_model_path(progress=False)), device="cpu")
    prompt = "Write a short story about a robot who learns to paint. " * 4
    params = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True)
    for batch in (1, 32):
        llm.generate([prompt] * batch, params, use_tqdm=False)
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            out = llm.generate([prompt + str(i) for i in range(batch)], params, use_tqdm=False)
            best = max(best, sum(len(o.token_ids) for o in out) / (time.perf_counter() - t))
        print(f"{mode:<8} batch {batch:>2}: {best:7.1f} output tok/s (best of 3, 64 tokens at temperature 0.7)",
              flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for mode in ("plain", "platform"):
            subprocess.run([sys.executable, __file__, mode], check=True)
