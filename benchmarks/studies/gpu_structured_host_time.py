"""Where a batch-64 step's host time goes under a JSON schema on one GPU: each EngineCore part timed (forward
launch, collect, apply, the grammars' accepts, the mask fill on its thread, the wait for it, masked sampling),
the bench's random Qwen3-0.6B, 256 tokens a sequence, with and without the schema, for each structured-output
backend.

    python3 benchmarks/studies/gpu_structured_host_time.py [--backends xgrammar] [--cprofile]   # on the GPU machine
    python benchmarks/studies/gpu_structured_host_time.py --device cpu --tiny --cprofile         # the loop's Python

`--device cpu --tiny` runs the same steps, overlapped, on a tiny random Qwen3 (the same 151,936-token vocabulary),
so the forward is small and the profile is mostly the step loop's own Python.

The masked sampling is split further where the sampler masks and then draws (the bitmask's copy in, the masking,
the draw, the tokens' copy out; a platform's one-pass masked draw shows as `sample` alone), and `--cprofile` prints
each run's functions by their own time (Python 3.12's profiler sees every thread, the mask thread's too).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import json
import pstats
import time
from pathlib import Path

import torch

from nanoplug import LLM, SamplingParams
from nanoplug.bench.throughput import write_checkpoint
from nanoplug.worker import sampler as sampler_module

SCHEMA = Path("/work/shared/data/jsonschemabench/Github_easy/o11173.json")
PROMPT = "<|im_start|>user\nWrite a JSON object about a news article.<|im_end|>\n<|im_start|>assistant\n"


def timed(totals: collections.Counter, counts: collections.Counter, obj, name: str) -> None:
    """Wrap `obj.name` so each call adds its seconds to totals[name]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started
            counts[name] += 1

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="xgrammar,llguidance")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 instead of the 0.6B shape")
    parser.add_argument("--schema", type=Path, default=SCHEMA, help="the JSON schema (default: JSONSchemaBench's o11173)")
    args = parser.parse_args()
    if args.tiny:
        import tempfile

        from nanoplug.bench.checkpoints import write_random_checkpoint
        model = str(write_random_checkpoint(Path(tempfile.gettempdir()) / "nanoplug-host-time-tiny"))
    else:
        model = str(write_checkpoint())
    schema = json.loads(args.schema.read_text())
    for backend in args.backends.split(","):
        options = dict(dtype="bfloat16") if args.device == "cuda" else dict(dtype="float32", overlap_steps=True,
                                                                               num_kv_blocks=1024)
        llm = LLM(model, device=args.device, structured_output=backend, max_model_len=2048, max_num_seqs=64,
                  **options)
        core = llm.engine
        totals, counts = collections.Counter(), collections.Counter()
        for obj, name in ((core.worker, "collect"), (core.worker, "sample"), (core.worker, "launch"), (core, "step"),
                          (core.structured, "accept"), (core.structured, "masks"), (core, "_apply"),
                          (core, "_accept"), (core.structured, "begin"), (core.structured, "end"),
                          (core.scheduler, "schedule"), (core.builder, "build"),
                          (core.worker.sampler, "masked"), (core.worker.sampler, "_sample"),
                          (core.worker.platform, "to_host"), (sampler_module, "to_device")):
            timed(totals, counts, obj, name)
        fill_of = core.structured._filler

        def filler(seqs):  # the thread's part of each fill, timed where it runs
            bitmask, fill = fill_of(seqs)

            def timed_fill():
                started = time.perf_counter()
                try:
                    fill()
                finally:
                    totals["fill (thread)"] += time.perf_counter() - started
                    counts["fill (thread)"] += 1
            return bitmask, timed_fill

        core.structured._filler = filler
        if core.worker.sampler.masker is not None:
            timed(totals, counts, core.worker.sampler, "masker")
        for label, extra in (("free", {"ignore_eos": True}), ("schema", {"structured_outputs": {"json": schema}})):
            params = SamplingParams(temperature=0.8, max_tokens=256, **extra)
            llm.generate([PROMPT] * 64, params, use_tqdm=False)  # warm (and compile the grammar)
            totals.clear()
            counts.clear()
            profiler = cProfile.Profile() if args.cprofile else None
            started = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            outs = llm.generate([PROMPT] * 64, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            if profiler is not None:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            parts = {k: f"{1e3 * v / counts[k]:.3f} ms x{counts[k]}" for k, v in totals.items()}
            print(f"{backend} {label}: {1e3 * seconds / (tokens / 64):.3f} ms/token", parts, flush=True)
        llm.close()
        del llm, core
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
