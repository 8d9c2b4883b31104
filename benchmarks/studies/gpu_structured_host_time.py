"""Where a batch-64 step's host time goes under a JSON schema on one GPU: each EngineCore part timed (forward
launch, collect, apply, the grammars' accepts, mask fill, masked sampling), the bench's random Qwen3-0.6B, 256
tokens a sequence, with and without the schema, for each structured-output backend.

    python3 benchmarks/studies/gpu_structured_host_time.py    # on the GPU machine (xgrammar and llguidance)
"""
from __future__ import annotations

import collections
import gc
import json
import time
from pathlib import Path

import torch

from nanoplug import LLM, SamplingParams
from nanoplug.bench.throughput import write_checkpoint

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
    model = str(write_checkpoint())
    schema = json.loads(SCHEMA.read_text())
    for backend in ("xgrammar", "llguidance"):
        llm = LLM(model, device="cuda", structured_output=backend, max_model_len=2048, max_num_seqs=64,
                  dtype="bfloat16")
        core = llm.engine
        totals, counts = collections.Counter(), collections.Counter()
        for obj, name in ((core.worker, "collect"), (core.worker, "sample"), (core.worker, "launch"), (core, "step"),
                          (core.structured, "accept"), (core.structured, "masks"), (core, "_apply")):
            timed(totals, counts, obj, name)
        for label, extra in (("free", {"ignore_eos": True}), ("schema", {"structured_outputs": {"json": schema}})):
            params = SamplingParams(temperature=0.8, max_tokens=256, **extra)
            llm.generate([PROMPT] * 64, params, use_tqdm=False)  # warm (and compile the grammar)
            totals.clear()
            counts.clear()
            started = time.perf_counter()
            outs = llm.generate([PROMPT] * 64, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            parts = {k: f"{1e3 * v / counts[k]:.3f} ms x{counts[k]}" for k, v in totals.items()}
            print(f"{backend} {label}: {1e3 * seconds / (tokens / 64):.3f} ms/token", parts, flush=True)
        llm.close()
        del llm, core
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
