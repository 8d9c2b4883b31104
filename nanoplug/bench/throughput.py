"""The throughput workload of ../shared/BENCHMARK.md (nano-vllm's `bench.py`), exactly, and static batches.

A seeded random Qwen3-0.6B-shape bf16 checkpoint with the real Qwen3 tokenizer (throughput does not
depend on the weights' values), 256 requests drawn with `random.seed(0)`, max_model_len 4096, one
untimed warm-up generate, and the figure: output tokens over the wall seconds of one `generate`.

Static batches (`--static-batches N`, `static_batch=N`) put the same workload through as consecutive
batches of N requests, each sent only once the one before has finished, with max_num_seqs=N: the
batching that continuous batching replaces. `--compare-static N` (`run_static_comparison`) times
continuous batching and then static batches on one engine with max_num_seqs=N and prints both and
their ratio, the gain continuous batching brings; `--max-num-seqs N` alone gives the continuous figure.
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

    from nanoplug.bench.checkpoints import QWEN3_0_6B_SHAPE, write_random_checkpoint

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
    max_num_seqs: int = 256
    static_batch: int | None = None  # None: continuous batching
    engine: str = ""  # describe_engine's line

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class StaticComparison:
    continuous: BenchResult
    static: BenchResult

    @property
    def ratio(self) -> float:
        """How many times the output tok/s of continuous batching that of static batches is."""
        return self.continuous.output_tok_per_s / self.static.output_tok_per_s


def open_engine(model: str | Path | None = None, **engine_options: Any):
    """The bench's engine, after one untimed warm-up generate, and its start-up seconds."""
    from nanoplug import LLM, SamplingParams

    engine_options.setdefault("max_model_len", 4096)
    t0 = time.perf_counter()
    llm = LLM(str(model or write_checkpoint()), **engine_options)
    startup = time.perf_counter() - t0
    try:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    except BaseException:
        llm.close()
        raise
    return llm, startup


def describe_engine(llm) -> str:
    """How the engine ran, in one line (benchmarks/gpu_tp.py reads it): steps overlapped or one at a time, the
    KV cache's tokens, and what the decode steps since start-up ran as (the worker's report)."""
    core = llm.engine
    line = (f"engine: steps {'overlapped' if core.overlap else 'one at a time'}; "
            f"KV cache {core.num_kv_blocks * core.config.kv_block_size:,} tokens")
    report = core.worker.report()
    if report is not None:
        s = report.stats
        line += (f"; decode steps: {s.graph_replays:,} graph replays, {s.eager_decode_steps:,} eager, "
                 f"{s.eager_decode_steps_by_design:,} eager by design")
        if report.graphs_error:
            line += f"; graphs failed: {report.graphs_error}"
    return line


def static_engine_options(batch: int, engine_options: dict[str, Any]) -> dict[str, Any]:
    """engine_options with max_num_seqs = batch: a static batch runs whole, and no more sequences than it."""
    from nanoplug.errors import ConfigError

    if batch < 1:
        raise ConfigError(f"a static batch of {batch} requests cannot run; give a batch size of 1 or more")
    if engine_options.get("max_num_seqs", batch) != batch:
        raise ConfigError(f"static batches of {batch} run with max_num_seqs={batch}, but max_num_seqs="
                          f"{engine_options['max_num_seqs']} was given; leave max_num_seqs out")
    return {**engine_options, "max_num_seqs": batch}


def time_workload(llm, prompts: list[list[int]], params: list, static_batch: int | None, startup: float) -> BenchResult:
    """Run the workload once, timed: one `generate`, or (static_batch=N) one `generate` per N requests in turn."""
    size = static_batch or len(prompts)
    t = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), size):
        outputs += llm.generate(prompts[i:i + size], params[i:i + size], use_tqdm=False)
    seconds = time.perf_counter() - t
    output_tokens = sum(len(o.token_ids) for o in outputs)
    expected = sum(p.max_tokens for p in params)
    if output_tokens != expected:
        raise RuntimeError(f"the engine produced {output_tokens} output tokens, the workload asks {expected}")
    return BenchResult(seconds, sum(map(len, prompts)), output_tokens, startup, llm.describe_plugins(),
                       llm.config.max_num_seqs, static_batch, describe_engine(llm))


def run_bench(model: str | Path | None = None, num_seqs: int = NUM_SEQS, max_input_len: int = MAX_INPUT_LEN,
              max_output_len: int = MAX_OUTPUT_LEN, static_batch: int | None = None,
              **engine_options: Any) -> BenchResult:
    """The workload with continuous batching, or in static batches of `static_batch` requests."""
    if static_batch is not None:
        engine_options = static_engine_options(static_batch, engine_options)
    llm, startup = open_engine(model, **engine_options)
    try:
        return time_workload(llm, *workload(num_seqs, max_input_len, max_output_len), static_batch, startup)
    finally:
        llm.close()


def run_static_comparison(model: str | Path | None = None, batch: int = 64, num_seqs: int = NUM_SEQS,
                          max_input_len: int = MAX_INPUT_LEN, max_output_len: int = MAX_OUTPUT_LEN,
                          **engine_options: Any) -> StaticComparison:
    """The workload with continuous batching, then in static batches of `batch`, on one engine with
    max_num_seqs=batch. Each mode first runs the workload once untimed, so neither timed run pays for
    kernels a first shape compiles (FlashAttention-4 JIT-compiles each new variant for seconds). Prefix
    caching is off: a later run would otherwise find an earlier one's prompts cached."""
    engine_options = static_engine_options(batch, {**engine_options, "enable_prefix_caching": False})
    llm, startup = open_engine(model, **engine_options)
    try:
        prompts, params = workload(num_seqs, max_input_len, max_output_len)
        for static_batch in (None, batch):  # the rehearsal
            time_workload(llm, prompts, params, static_batch, startup)
        return StaticComparison(time_workload(llm, prompts, params, None, startup),
                                time_workload(llm, prompts, params, batch, startup))
    finally:
        llm.close()
