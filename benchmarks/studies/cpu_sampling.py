"""The default model on this CPU, sampled: output tok/s at batch 1 and 32 for requests at a temperature alone,
with top-p, with top-k and with a seed each, with the cpu platform's samplers (one uniform number a row: the
temperature sampler, and the inverse-CDF draw for filtered and seeded rows) and with the plain sampler (an
exponential number per logit), each in its own process.

usage: python benchmarks/studies/cpu_sampling.py [plain|platform] [--batches 1,32] [--kinds temperature,top-p,top-k,seeded]
       (no mode: both, one after the other)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

KINDS = {"temperature": {}, "top-p": {"top_p": 0.9}, "top-k": {"top_k": 50}, "seeded": {}}


def run(mode: str, batches: list[int], kinds: list[str]) -> None:
    from nanoplug import LLM, SamplingParams
    from nanoplug.checkpoint.default_model import default_model_path
    from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

    if mode == "plain":
        CpuPlatform.temperature_sampler = lambda self: None
        CpuPlatform.inverse_cdf_sampler = lambda self: None
    llm = LLM(str(default_model_path(progress=False)), device="cpu")
    prompt = "Write a short story about a robot who learns to paint. " * 4
    for kind in kinds:
        for batch in batches:
            params = [SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True,
                                     seed=i if kind == "seeded" else None, **KINDS[kind]) for i in range(batch)]
            llm.generate([prompt] * batch, params, use_tqdm=False)
            best = 0.0
            for _ in range(3):
                t = time.perf_counter()
                out = llm.generate([prompt + str(i) for i in range(batch)], params, use_tqdm=False)
                best = max(best, sum(len(o.token_ids) for o in out) / (time.perf_counter() - t))
            print(f"{mode:<8} {kind:<11} batch {batch:>2}: {best:7.1f} output tok/s (best of 3, 64 tokens at "
                  "temperature 0.7)", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=["plain", "platform"])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    batches, kinds = [int(b) for b in args.batches.split(",")], args.kinds.split(",")
    if args.mode:
        run(args.mode, batches, kinds)
    else:
        for mode in ("plain", "platform"):
            subprocess.run([sys.executable, __file__, mode, "--batches", args.batches, "--kinds", args.kinds],
                           check=True)
