"""What the start-up guarantees are checked with (tests/test_graph_guard.py on the CPU, tests/gpu/test_gpu_startup.py
on CUDA): process-wide counters of what compiles, a mixed workload of 100 requests, a record of the steps a
worker launches, and the parsed start-up line.

An engine that compiles or captures inside a request's steps stalls that request for as long as the compile
takes; one that silently decodes eager is slower than it says. Counters taken after `LLM(...)` returns and
again after the workload must then be equal.
"""
from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

from nanoplug import SamplingParams


class Compilations:
    """Counts, for as long as it is entered, Triton JIT kernels compiled in this process (a specialization the
    kernel's in-memory cache missed: compiled, or loaded from Triton's disk cache), by their signature; and
    reads torch.compile's graphs (dynamo's `unique_graphs`: every compiled frame, recompiles included)."""

    def __init__(self):
        self.triton: list[str] = []
        self.watching_triton = False  # the hook is in (triton imports, with its runtime knobs)
        self._knobs = self._previous = None

    def __enter__(self) -> "Compilations":
        try:
            from triton import knobs
        except Exception:  # no triton here: nothing of it can compile
            return self
        self._knobs, self._previous = knobs, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._compiled
        self.watching_triton = True
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._previous
            self.watching_triton = False

    def _compiled(self, *, repr, **kwargs):  # noqa: A002  (triton's keyword)
        self.triton.append(repr)
        if self._previous is not None:
            return self._previous(repr=repr, **kwargs)
        return None

    @staticmethod
    def dynamo_graphs() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]


class StepLog:
    """Wraps a single-process worker's `run` and `launch` (the engine calls one or the other per step):
    (is_prefill, number of sequences) of every step."""

    def __init__(self, worker):
        self.steps: list[tuple[bool, int]] = []
        for name in ("run", "launch"):
            setattr(worker, name, self._logged(getattr(worker, name)))

    def _logged(self, method):
        def logged(step):
            self.steps.append((step.is_prefill, len(step.query_lens)))
            return method(step)

        return logged

    def decode_batches(self) -> list[int]:
        return [n for prefill, n in self.steps if not prefill]


def _request(rng: random.Random, vocab: int, max_prompt: int) -> tuple[list[int], SamplingParams]:
    length = rng.choice([n for n in (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 47, 64, 100, 160) if n <= max_prompt])
    seed = rng.randrange(1 << 16)
    params = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True, temperature=rng.choice([0.0, 0.8]),
                            seed=rng.choice([seed, None]))  # unseeded sampled rows take a platform's fast sampler
    return [rng.randrange(vocab) for _ in range(length)], params


def mixed_workload(llm, seed: int = 0, max_prompt: int = 100) -> int:
    """100 requests with prompts of 1 to `max_prompt` tokens and 1 to 24 new tokens, greedy and sampled: generate
    calls of 1, 2, 4, 7, 13 and 40 prompts, then 12 streams in threads beside a generate of 20, then one stream.
    Each must get exactly its max_tokens (EOS ignored). Returns the number of requests run."""
    rng = random.Random(seed)
    vocab = llm.engine.facts.vocab_size
    done = 0

    def check(outputs, requests):
        for out, (_, params) in zip(outputs, requests, strict=True):
            assert len(out.token_ids) == params.max_tokens, (len(out.token_ids), params)

    def stream(request):
        ids, params = request
        deltas = list(llm.stream(ids, params))
        assert deltas and deltas[-1].finished
        assert sum(len(d.token_ids) for d in deltas) == params.max_tokens
        return len(deltas)

    for size in (1, 2, 4, 7, 13, 40):
        requests = [_request(rng, vocab, max_prompt) for _ in range(size)]
        check(llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False), requests)
        done += size
    streams = [_request(rng, vocab, max_prompt) for _ in range(12)]
    batch = [_request(rng, vocab, max_prompt) for _ in range(20)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        futures = [pool.submit(stream, r) for r in streams]
        check(llm.generate([r[0] for r in batch], [r[1] for r in batch], use_tqdm=False), batch)
        for f in futures:
            f.result()
    done += 32
    stream(_request(rng, vocab, max_prompt))
    return done + 1


STARTUP_LINE = re.compile(
    r"engine ready in (?P<engine>[\d.]+) s; worker start-up (?P<total>[\d.]+) s = load (?P<load>[\d.]+) s \+ "
    r"KV cache (?P<kv_cache>[\d.]+) s \+ compile (?P<compile>[\d.]+) s \+ warm-up (?P<warm_up>[\d.]+) s \+ "
    r"graphs (?P<graphs>[\d.]+) s")
PHASES = ("load", "kv_cache", "compile", "warm_up", "graphs")


def startup_lines(text: str) -> list[dict[str, float]]:
    """The start-up lines in a log's text, each as {phase: seconds} with 'total' and 'engine'."""
    return [{k: float(v) for k, v in m.groupdict().items()} for m in STARTUP_LINE.finditer(text)]


def check_startup_line(text: str, report) -> None:
    """One start-up line, naming every phase; the phases add up to the worker's total (each printed to the
    millisecond), which the engine's own time includes; the figures are the worker's."""
    (line,) = startup_lines(text)
    assert all(line[p] >= 0 for p in PHASES)
    assert abs(sum(line[p] for p in PHASES) - line["total"]) <= 0.003 + 0.01 * line["total"], line
    assert line["engine"] >= line["total"]
    startup = report.startup
    assert abs(startup.total_s - sum(getattr(startup, f"{p}_s") for p in PHASES)) < 1e-6
    assert abs(line["total"] - startup.total_s) <= 0.0006

