"""`nanoplug bench --latency`: time to first token, batch-1 decode and prefill speed, none flattered by a cache hit.

On the throughput bench's engine (nanoplug/bench/throughput.py: same checkpoint and options), after an untimed
warm-up of each measurement:

- time to first token: 20 prompts of 512 tokens, each sent alone to an idle engine, timed from
  submitting the request to its first token arriving; the median (min and max beside it);
- batch-1 decode: one 128-token prompt and 256 tokens (eos ignored), timed from its first token to its
  last, over the tokens between;
- prefill: 64 prompts of 1024 tokens, one output token each, sent at once; prompt tokens over wall seconds.

Every prompt is fresh (FreshPrompts) and every request is checked to have found none of its tokens in
the prefix cache, so no figure can be a cache hit's. Requests go through the engine core step by step,
the calls `LLM.stream` makes, because its updates carry how many prompt tokens the cache held.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoplug.bench.throughput import describe_engine, open_engine

TTFT_PROMPTS = 20
TTFT_PROMPT_LEN = 512
DECODE_PROMPT_LEN = 128
DECODE_TOKENS = 256
PREFILL_PROMPTS = 64
PREFILL_PROMPT_LEN = 1024
# a TTFT request goes on after its first token, as a streamed answer does: one that ends there would
# skip the decode step an overlapped engine launches before it hands the first token back
TTFT_MAX_TOKENS = 16
BODY_IDS = 10000  # ids of the tokens after the first (the throughput workload's range); first ids lie above


class FreshPrompts:
    """Random token-id prompts that share no prefix: each starts with an id no earlier prompt started with.

    A prefix-cache hit needs a prompt's whole first block to equal a cached sequence's first block (the
    block hashes chain from there), so a first token never used before rules out every hit."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.next_first = BODY_IDS

    def take(self, count: int, length: int) -> list[list[int]]:
        from nanoplug.errors import ConfigError

        if self.next_first + count > self.vocab_size:
            raise ConfigError(f"the latency prompts need first token ids up to {self.next_first + count - 1}, but the "
                              f"checkpoint's vocabulary has {self.vocab_size} ids; use fewer latency prompts or a "
                              "checkpoint with a larger vocabulary")
        prompts = [[self.next_first + k] + [self.rng.randrange(BODY_IDS) for _ in range(length - 1)]
                   for k in range(count)]
        self.next_first += count
        return prompts


@dataclass
class LatencyResult:
    ttft_ms: list[float]  # each prompt's time to first token, in the order sent
    ttft_prompt_len: int
    decode_ms_per_token: float
    decode_tokens: int  # the tokens the decode figure is over: those after the first
    decode_prompt_len: int
    prefill_seconds: float
    prefill_prompts: int
    prefill_prompt_len: int
    startup_seconds: float
    plugins: list[str]
    engine: str = ""  # nanoplug.bench.throughput.describe_engine's line

    @property
    def ttft_median_ms(self) -> float:
        return statistics.median(self.ttft_ms)

    @property
    def prefill_tok_per_s(self) -> float:
        return self.prefill_prompts * self.prefill_prompt_len / self.prefill_seconds


def check_no_cache_hit(cached_tokens: int, what: str) -> None:
    if cached_tokens:
        raise RuntimeError(f"{what} found {cached_tokens} of its prompt tokens in the prefix cache, so its time would "
                           "be flattered by the hit; latency prompts must share no prefix with anything run before "
                           "(FreshPrompts gives each a first token no earlier prompt had)")


def stream_alone(engine, prompt: list[int], params, what: str) -> list[tuple[float, int]]:
    """Send one request to the idle engine and step it until idle again: (seconds since sending, tokens
    added) of each update that brought tokens."""
    if engine.has_unfinished():
        raise RuntimeError(f"{what} must run on an idle engine, but it still has requests")
    start = time.perf_counter()
    request = engine.make_request(prompt, params)
    engine.add_request(request)
    arrivals = []
    while engine.has_unfinished():
        updates = engine.step()
        now = time.perf_counter()
        for u in updates:
            check_no_cache_hit(u.num_cached_tokens, what)
            if u.token_ids:
                arrivals.append((now - start, len(u.token_ids)))
    return arrivals


def measure(llm, fresh: FreshPrompts, ttft_prompts: int, ttft_prompt_len: int, decode_prompt_len: int,
            decode_tokens: int, prefill_prompts: int, prefill_prompt_len: int) -> dict[str, Any]:
    """The three measurements once, as LatencyResult's fields."""
    from nanoplug import SamplingParams

    ttft_params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=TTFT_MAX_TOKENS)
    ttft_ms = [stream_alone(llm.engine, p, ttft_params, f"time-to-first-token prompt {i}")[0][0] * 1000
               for i, p in enumerate(fresh.take(ttft_prompts, ttft_prompt_len))]

    (prompt,) = fresh.take(1, decode_prompt_len)
    arrivals = stream_alone(llm.engine, prompt, SamplingParams(temperature=0.6, ignore_eos=True,
                                                               max_tokens=decode_tokens), "the batch-1 decode prompt")
    after_first = sum(n for _, n in arrivals) - arrivals[0][1]
    if after_first < 1:
        raise RuntimeError(f"the batch-1 decode prompt gave {after_first + arrivals[0][1]} token(s) in one update; "
                           "a decode figure needs tokens after the first: ask for at least 2")

    prompts = fresh.take(prefill_prompts, prefill_prompt_len)
    t = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1), use_tqdm=False)
    prefill_seconds = time.perf_counter() - t
    for i, o in enumerate(outputs):
        check_no_cache_hit(o.num_cached_tokens, f"prefill prompt {i}")
    return dict(ttft_ms=ttft_ms, ttft_prompt_len=ttft_prompt_len,
                decode_ms_per_token=(arrivals[-1][0] - arrivals[0][0]) * 1000 / after_first,
                decode_tokens=after_first, decode_prompt_len=decode_prompt_len, prefill_seconds=prefill_seconds,
                prefill_prompts=prefill_prompts, prefill_prompt_len=prefill_prompt_len)


def run_latency(model: str | Path | None = None, ttft_prompts: int = TTFT_PROMPTS,
                ttft_prompt_len: int = TTFT_PROMPT_LEN, decode_prompt_len: int = DECODE_PROMPT_LEN,
                decode_tokens: int = DECODE_TOKENS,
                prefill_prompts: int = PREFILL_PROMPTS, prefill_prompt_len: int = PREFILL_PROMPT_LEN,
                **engine_options: Any) -> LatencyResult:
    """Warm up (one TTFT prompt, a short decode, the prefill batch at full size: its shapes are the
    costly first ones), then measure."""
    from nanoplug.errors import ConfigError

    sizes = dict(ttft_prompts=ttft_prompts, ttft_prompt_len=ttft_prompt_len, decode_prompt_len=decode_prompt_len,
                 prefill_prompts=prefill_prompts, prefill_prompt_len=prefill_prompt_len)
    bad = [f"{name}={value} (at least 1)" for name, value in sizes.items() if value < 1]
    if decode_tokens < 2:
        bad.append(f"decode_tokens={decode_tokens} (at least 2: the figure is over the tokens after the first)")
    if bad:
        raise ConfigError(f"latency sizes out of range: {', '.join(bad)}")
    llm, startup = open_engine(model, **engine_options)
    try:
        fresh = FreshPrompts(llm.engine.facts.vocab_size)
        measure(llm, fresh, **{**sizes, "ttft_prompts": 1, "decode_tokens": min(decode_tokens, 16)})
        return LatencyResult(**measure(llm, fresh, **sizes, decode_tokens=decode_tokens), startup_seconds=startup,
                             plugins=llm.describe_plugins(), engine=describe_engine(llm))
    finally:
        llm.close()
