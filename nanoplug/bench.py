"""The throughput workload of ../shared/BENCHMARK.md (nano-vllm's `bench.py`), exactly.

A seeded random Qwen3-0.6B-shape bf16 checkpoint with the real Qwen3 tokenizer (throughput does not
depend on the weights' values), 256 requests drawn with `random.seed(0)`, max_model_len 4096, one
untimed warm-up generate, and the figure: output tokens over the wall seconds of one `generate`.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from random import randint, seed
from typing import Any

NUM_SEQS = 256
MAX_INPUT_LEN = 1024
MAX_OUTPUT_LEN = 1024


def default_checkpoint_dir() -> Path:
    return Path(tempfile.gettempdir()) / "nanoplug-bench" / "qwen3-0.6b-random"


def write_checkpoint(folder: str | Path | None = None) -> Path:
    """The Qwen3-0.6B-shape random checkpoint (written once, then reused)."""
    import torch

    from nanoplug.checkpoints import QWEN3_0_6B_SHAPE, write_random_checkpoint

    return write_random_checkpoint(folder or default_checkpoint_dir(), dtype=torch.bfloat16, **QWEN3_0_6B_SHAPE)


def workload(num_seqs: int = NUM_SEQS, max_input_len: int = MAX_INPUT_LEN, max_output_len: int = MAX_OUTPUT_LEN):
    """Prompts (token ids) and SamplingParams, drawn exactly as nano-vllm's bench.py draws them."""
    from nanoplug import SamplingParams

    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


@dataclass
class BenchResult:
    seconds: float
    prompt_tokens: int
    output_tokens: int
    startup_seconds: float
    plugins: list[str]

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_bench(model: str | Path | None = None, num_seqs: int = NUM_SEQS, max_input_len: int = MAX_INPUT_LEN,
              max_output_len: int = MAX_OUTPUT_LEN, **engine_options: Any) -> BenchResult:
    from nanoplug import LLM, SamplingParams

    model = str(model or write_checkpoint())
    engine_options.setdefault("max_model_len", 4096)
    t0 = time.perf_counter()
    llm = LLM(model, **engine_options)
    startup = time.perf_counter() - t0
    try:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # untimed warm-up
        prompts, params = workload(num_seqs, max_input_len, max_output_len)
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        output_tokens = sum(len(o.token_ids) for o in outputs)
        expected = sum(p.max_tokens for p in params)
        if output_tokens != expected:
            raise RuntimeError(f"the engine produced {output_tokens} output tokens, the workload asks {expected}")
        return BenchResult(seconds, sum(map(len, prompts)), output_tokens, startup, llm.describe_plugins())
    finally:
        llm.close()
