"""`nanoplug bench --latency`, `--static-batches`, `--compare-static` and `--max-num-seqs` on a tiny checkpoint.

Every engine call is recorded (EngineCore.add_request and step wrapped), so the tests see what the
figures rest on: no prefix-cache hit, a TTFT prompt sent to an idle engine, a static batch sent only
once the one before has finished, max_num_seqs as asked. The timings themselves are only checked to be
positive: on a shared CPU they say nothing.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from _checkpoints import checkpoint
from nanoplug.bench import latency as bench_latency, throughput as bench
from nanoplug.bench.latency import BODY_IDS, FreshPrompts
from nanoplug.cli import main
from nanoplug.engine.engine_core import EngineCore
from nanoplug.errors import ConfigError

ENGINE = dict(device="cpu", kv_block_size=16, max_model_len=256, num_kv_blocks=256)
ENGINE_FLAGS = ["--device", "cpu", "--kv-block-size", "16", "--max-model-len", "256"]
# three lengths apart, so a recorded prompt tells which measurement sent it
SIZES = dict(ttft_prompts=3, ttft_prompt_len=40, decode_prompt_len=20, decode_tokens=8, prefill_prompts=4,
             prefill_prompt_len=48)
WORKLOAD = dict(num_seqs=4, max_input_len=100, max_output_len=100)  # the workload's least: 100 tokens in and out
WORKLOAD_FLAGS = ["--num-seqs", "4", "--max-input-len", "100", "--max-output-len", "100"]


@pytest.fixture
def engine_log(monkeypatch):
    """Every request added ("add", prompt, whether the engine was busy) and finished ("done", prompt), in
    order; each step's max_num_seqs and prefix-caching setting; every update's cached prompt tokens."""
    log = SimpleNamespace(events=[], max_num_seqs=set(), prefix_caching=set(), cached=[])
    prompt_of = {}
    add, step = EngineCore.add_request, EngineCore.step

    def recording_add(self, request):
        prompt = tuple(request.prompt_token_ids)
        prompt_of[id(self), request.request_id] = prompt
        log.events.append(("add", prompt, self.has_unfinished()))
        return add(self, request)

    def recording_step(self):
        updates = step(self)
        log.max_num_seqs.add(self.config.max_num_seqs)
        log.prefix_caching.add(self.config.enable_prefix_caching)
        for u in updates:
            log.cached.append(u.num_cached_tokens)
            if u.finished:
                log.events.append(("done", prompt_of[id(self), u.request_id], None))
        return updates

    monkeypatch.setattr(EngineCore, "add_request", recording_add)
    monkeypatch.setattr(EngineCore, "step", recording_step)
    return log


def workload_runs(events: list, size: int) -> list[list[tuple[str, int]]]:
    """The recorded events of the workload's prompts as (kind, batch of `size`), one list per run of it."""
    prompts, _ = bench.workload(**WORKLOAD)
    batch_of = {tuple(p): i // size for i, p in enumerate(prompts)}
    runs, done = [[]], 0
    for kind, prompt, _ in events:
        if prompt in batch_of:
            runs[-1].append((kind, batch_of[prompt]))
            done += kind == "done"
            if done == len(prompts):
                runs.append([])
                done = 0
    return [r for r in runs if r]


def assert_static(run: list[tuple[str, int]], size: int) -> None:
    """Each request of batch b is added only once every request of batch b-1 has finished."""
    for pos, (kind, batch) in enumerate(run):
        if kind == "add" and batch > 0:
            finished_before = sum(1 for k, b in run[:pos] if k == "done" and b == batch - 1)
            assert finished_before == size, f"a request of batch {batch} entered before batch {batch - 1} finished"


def assert_continuous(run: list[tuple[str, int]]) -> None:
    kinds = [k for k, _ in run]
    assert kinds == ["add"] * WORKLOAD["num_seqs"] + ["done"] * WORKLOAD["num_seqs"]  # all in at once


# ------------------------------------------------------------------------------------ latency
def test_fresh_prompts_share_no_first_token_and_say_when_the_vocabulary_runs_out():
    fresh = FreshPrompts(vocab_size=BODY_IDS + 5, seed=3)
    prompts = fresh.take(2, 7) + fresh.take(3, 1)
    assert [len(p) for p in prompts] == [7, 7, 1, 1, 1]
    assert [p[0] for p in prompts] == list(range(BODY_IDS, BODY_IDS + 5))  # never used by a body token
    assert all(0 <= t < BODY_IDS for p in prompts for t in p[1:])
    with pytest.raises(ConfigError, match=f"up to {BODY_IDS + 5}.*vocabulary has {BODY_IDS + 5} ids; use fewer"):
        fresh.take(1, 4)


def test_latency_reports_three_positive_figures_none_from_the_prefix_cache(engine_log):
    # overlapped steps (CUDA's default): the first token comes back after the next step is launched
    r = bench_latency.run_latency(checkpoint("qwen3"), **SIZES, **ENGINE, overlap_steps=True)
    assert len(r.ttft_ms) == 3 and min(r.ttft_ms) > 0 and min(r.ttft_ms) <= r.ttft_median_ms <= max(r.ttft_ms)
    assert r.decode_ms_per_token > 0 and r.decode_tokens == 7  # the 8 tokens but the first
    assert r.prefill_tok_per_s > 0 and r.prefill_seconds > 0
    assert (r.ttft_prompt_len, r.decode_prompt_len, r.prefill_prompts, r.prefill_prompt_len) == (40, 20, 4, 48)
    assert r.startup_seconds > 0 and any(line.startswith("attention:") for line in r.plugins)

    assert engine_log.cached and set(engine_log.cached) == {0}
    adds = [(prompt, busy) for kind, prompt, busy in engine_log.events if kind == "add"]
    by_len = {n: [busy for prompt, busy in adds if len(prompt) == n] for n in (40, 20, 48)}
    assert len(by_len[40]) == 1 + 3 and len(by_len[20]) == 2 and len(by_len[48]) == 2 * 4  # warm-up, then timed
    assert not any(by_len[40] + by_len[20])  # each TTFT and decode prompt went to an idle engine
    firsts = [prompt[0] for prompt, _ in adds if len(prompt) in by_len]
    assert len(set(firsts)) == len(firsts)  # no two latency prompts begin alike


@pytest.mark.parametrize("repeated, message", [
    (40, "time-to-first-token prompt 0 found 32 of its prompt tokens in the prefix cache"),
    (20, "the batch-1 decode prompt found 16 of its prompt tokens in the prefix cache"),
    (48, "prefill prompt 0 found 32 of its prompt tokens in the prefix cache"),
])
def test_a_repeated_latency_prompt_fails_the_cache_check(monkeypatch, repeated, message):
    fresh_take = FreshPrompts.take

    def take(self, count, length):  # the prompts of one measurement all the same: its warm-up fills the cache
        prompts = fresh_take(self, count, length)
        return [[BODY_IDS - 1] * length for _ in prompts] if length == repeated else prompts

    monkeypatch.setattr(FreshPrompts, "take", take)
    with pytest.raises(RuntimeError, match=message):
        bench_latency.run_latency(checkpoint("qwen3"), **SIZES, **ENGINE)


@pytest.mark.parametrize("size, value", [("ttft_prompts", 0), ("ttft_prompt_len", 0), ("decode_prompt_len", 0),
                                         ("decode_tokens", 1), ("prefill_prompts", 0), ("prefill_prompt_len", 0)])
def test_latency_sizes_out_of_range_are_refused_before_the_engine_starts(size, value):
    with pytest.raises(ConfigError, match=f"latency sizes out of range: {size}={value}"):
        bench_latency.run_latency("/nonexistent", **{**SIZES, size: value})


def test_cli_latency_prints_the_three_figures(capsys):
    flags = ["--latency-prompts", "2", "--ttft-prompt-len", "40", "--decode-prompt-len", "20", "--decode-tokens", "5",
             "--prefill-prompts", "3", "--prefill-prompt-len", "48"]
    assert main(["bench", "--latency", "--model", checkpoint("qwen3"), *flags, *ENGINE_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "latency on an idle engine, no prefix-cache hits:" in out
    ttft = re.search(r"time to first token, 40-token prompt: median ([\d.]+) ms \(min ([\d.]+), max ([\d.]+)\) "
                     r"over 2 prompts", out)
    decode = re.search(r"batch-1 decode, 20-token prompt: ([\d.]+) ms/token over 4 tokens", out)
    prefill = re.search(r"prefill, 3 x 48-token prompts: ([\d,]+) tok/s \(([\d.]+) s\)", out)
    assert ttft and decode and prefill, out
    assert float(ttft[1]) > 0 and float(decode[1]) > 0 and int(prefill[1].replace(",", "")) > 0
    # how the engine ran (benchmarks/gpu_tp.py reads this line): CPU steps one at a time, decode steps counted
    engine = re.search(r"engine: steps one at a time; KV cache ([\d,]+) tokens; decode steps: ([\d,]+) graph replays, "
                       r"([\d,]+) eager, ([\d,]+) eager by design", out)
    assert engine, out
    kv_tokens, *decode_steps = (int(engine[i].replace(",", "")) for i in (1, 2, 3, 4))
    assert kv_tokens > 0 and sum(decode_steps) > 0


# ------------------------------------------------------------------------------- static batches
def test_cli_static_batches_wait_for_the_batch_before(engine_log, capsys):
    args = ["bench", "--static-batches", "2", "--model", checkpoint("qwen3"), *WORKLOAD_FLAGS, *ENGINE_FLAGS]
    assert main(args) == 0
    assert "static batches of 2, max_num_seqs 2: Total: 400tok, Time: " in capsys.readouterr().out
    (run,) = workload_runs(engine_log.events, 2)
    assert_static(run, 2)
    assert engine_log.max_num_seqs == {2}


def test_cli_compare_static_runs_both_on_one_engine_and_prints_the_ratio(engine_log, capsys):
    args = ["bench", "--compare-static", "2", "--model", checkpoint("qwen3"), *WORKLOAD_FLAGS, *ENGINE_FLAGS]
    assert main(args) == 0
    out = capsys.readouterr().out
    rates = re.findall(r"(continuous batching|static batches of 2), max_num_seqs 2: Total: 400tok, "
                       r"Time: [\d.]+s, Throughput: ([\d,.]+) tok/s", out)
    assert [label for label, _ in rates] == ["continuous batching", "static batches of 2"], out
    continuous, static = (float(rate.replace(",", "")) for _, rate in rates)
    ratio = re.search(r"continuous / static batches of 2: ([\d.]+)x", out)
    assert ratio and float(ratio[1]) == pytest.approx(continuous / static, rel=0.02)
    assert out.count("start-up ") == 1  # one engine
    runs = workload_runs(engine_log.events, 2)
    assert len(runs) == 4  # an untimed rehearsal of each mode, then the timed runs
    for continuous_run, static_run in (runs[:2], runs[2:]):
        assert_continuous(continuous_run)
        assert_static(static_run, 2)
    assert engine_log.max_num_seqs == {2}
    assert engine_log.prefix_caching == {False} and set(engine_log.cached) == {0}  # the second run hits nothing


def test_cli_max_num_seqs_alone_runs_the_workload_continuously_with_that_many(engine_log, capsys):
    assert main(["bench", "--max-num-seqs", "3", "--model", checkpoint("qwen3"), *WORKLOAD_FLAGS, *ENGINE_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "continuous batching, max_num_seqs 3: Total: 400tok, Time: " in out
    assert "engine: steps one at a time; KV cache " in out
    (run,) = workload_runs(engine_log.events, 4)
    assert_continuous(run)
    assert engine_log.max_num_seqs == {3}


def test_static_comparison_result():
    r = bench.BenchResult(2.0, 10, 100, 1.0, [], 4, None)
    s = bench.BenchResult(5.0, 10, 100, 1.0, [], 4, 4)
    assert bench.StaticComparison(r, s).ratio == pytest.approx(2.5)


# ------------------------------------------------------------------------------------ misuse
@pytest.mark.parametrize("args, message", [
    (["--latency", "--num-seqs", "4"], "--num-seqs size the throughput workload, which --latency does not run; "
                                       "size the latency prompts with --latency-prompts"),
    (["--latency", "--max-input-len", "200", "--max-output-len", "200"],
     "--max-input-len, --max-output-len size the throughput workload"),
    (["--decode-tokens", "4"], "--decode-tokens size the latency prompts; add --latency"),
    (["--latency-prompts", "4", "--ttft-prompt-len", "9", "--decode-prompt-len", "9", "--prefill-prompts", "9",
      "--prefill-prompt-len", "9"], "--latency-prompts, --ttft-prompt-len, --decode-prompt-len, --prefill-prompts, "
                                    "--prefill-prompt-len size the latency prompts; add --latency"),
    (["--static-batches", "2", "--max-num-seqs", "3"],
     "static batches of 2 run with max_num_seqs=2, but max_num_seqs=3 was given; leave max_num_seqs out"),
    (["--compare-static", "0"], "a static batch of 0 requests cannot run; give a batch size of 1 or more"),
    (["--static-batches", "-1"], "a static batch of -1 requests cannot run"),
])
def test_cli_misuse_is_one_line_naming_the_fix(capsys, args, message):
    assert main(["bench", "--model", "/nonexistent", *args]) == 2  # refused before any engine starts
    err = capsys.readouterr().err
    assert err.startswith("nanoplug: error: ") and message in err, err


@pytest.mark.parametrize("modes", [["--latency", "--static-batches", "2"], ["--compare-static", "2", "--latency"],
                                   ["--static-batches", "2", "--compare-static", "2"]])
def test_cli_modes_exclude_each_other(capsys, modes):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *modes])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
