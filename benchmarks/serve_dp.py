"""Data-parallel serving on a shared-prefix workload: prefix-affinity dispatch against round robin, and the
front end's CPU cost per token with N replicas against one engine.

The workload (llm-d's shape): `--prefixes` long system prompts of `--prefix-len` random token ids, each request
one of them (in turn) plus its own `--suffix-len` tokens, greedy, `--output-len` tokens with EOS ignored, sent as
streaming /v1/completions by the official async openai client at `--concurrency`. Each replica's KV cache is
`--num-kv-blocks` blocks: small enough that one replica cannot keep every prefix (round robin makes each replica
see them all, so they evict each other), large enough for its share under affinity.

For each configuration it starts `nanoplug serve` (benchmarks/serve.py's Server) and sends the whole workload
(nothing untimed: the first request of each prefix computes it, as behind a gateway), then prints throughput,
mean and p50 TTFT, the front end's and the engines' CPU per output token, and a table last.

    python benchmarks/serve_dp.py                                   # CPU, the tiny random Qwen3 (minutes)
    python benchmarks/serve_dp.py --model qwen3-0.6b-random --replicas 2 --prefixes 16 --prefix-len 2048 \\
        --requests 512 --concurrency 64 --output-len 64 --num-kv-blocks 96 --kv-block-size 256   # the H200 run
    python benchmarks/serve_dp.py --configs 2:prefix      # one configuration (replicas:routing) per process

The clients run in `--client-processes` processes (8 on a machine of more than 4 cores): one Python process of
the openai client cannot keep 64 requests of 2,000-token prompts in flight against a GPU server. Each row also
gives the server's side (requests it held, its TTFT and engine queue time, each replica's load from /health), so
a client-bound run shows as one.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from serve import Server, drive_spread, percentile  # noqa: E402  (benchmarks/serve.py)


def workload(args) -> tuple[list[list[int]], list]:
    from nanoplug import SamplingParams

    rng = random.Random(args.seed)
    vocab = args.vocab_low, args.vocab_high
    prefixes = [[rng.randrange(*vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    order = [i % args.prefixes for i in range(args.requests)]
    rng.shuffle(order)  # requests of each prefix arrive spread over the run, as a gateway sees them
    prompts = [prefixes[i] + [rng.randrange(*vocab) for _ in range(args.suffix_len)] for i in order]
    params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)] * args.requests
    return prompts, params


def run_config(args, model: str, replicas: int, routing: str, prompts, params) -> dict:
    blocks = args.num_kv_blocks * args.replicas if replicas == 1 and args.equal_memory else args.num_kv_blocks
    engine = dict(device=args.device, dtype=args.dtype, attention=args.attention, kv_cache=args.kv_cache,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, num_kv_blocks=blocks,
                  kv_block_size=args.kv_block_size, cpu_kv_cache_gb=None)
    server_args = argparse.Namespace(concurrency=[args.concurrency], single_process=False, enforce_eager=False, **engine)
    extra = ("--data-parallel-size", str(replicas), "--data-parallel-routing", routing) if replicas > 1 else ()
    server = Server(server_args, model, extra)
    try:
        before = server.cpu_seconds()
        poller = MetricsPoller(server.url)
        results, start, end = drive_spread(server.url, "none", model, args.concurrency, prompts, params,
                                           args.client_processes)
        poller.stop()
        front, engines = (a - b for a, b in zip(server.cpu_seconds(), before))
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        final = scrape(server.url)
    finally:
        server.stop()
    ok = [r for r in results if r.ok]
    if len(ok) < len(results):  # what the clients saw, and the server's side of it
        print(f"{len(results) - len(ok)} requests failed: {sorted({r.error for r in results if not r.ok})}\n"
              f"the server's log, last 60 lines:\n{''.join(server.log[-60:])}", file=sys.stderr, flush=True)
    tokens = max(sum(r.tokens for r in ok), 1)
    seconds = end - start
    return {"replicas": replicas, "routing": routing if replicas > 1 else "-", "requests": len(results),
            "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.ok})[:3],
            "no_text": sum(r.no_text for r in ok),  # served requests whose tokens all had empty text
            "seconds": seconds, "output_tok_per_s": tokens / seconds,
            "requests_per_s": len(ok) / seconds, "ttft_mean_ms": 1e3 * sum(r.ttft for r in ok) / max(len(ok), 1),
            "ttft_p50_ms": 1e3 * percentile([r.ttft for r in ok], 0.5),
            "front_end_cpu_us_per_token": 1e6 * front / tokens, "engine_cpu_us_per_token": 1e6 * engines / tokens,
            "per_replica": [r.get("requests") for r in health.get("replicas", [])],
            # why one routing beats the other: rows each step could run, evictions, and what the cache saved
            "running_mean": poller.mean("vllm:num_requests_running"),
            "waiting_mean": poller.mean("vllm:num_requests_waiting"),
            "open_mean": poller.mean("nanoplug_num_requests_open"),  # in the server: running, waiting or on the way
            "open_per_replica": poller.per_replica("open"), "running_per_replica": poller.per_replica("running"),
            "waiting_per_replica": poller.per_replica("waiting"),
            # the server's side of the TTFT: arrival to first token, of which waiting in an engine's queue
            "server_ttft_mean_ms": mean_of(final, "vllm:time_to_first_token_seconds"),
            "queue_mean_ms": mean_of(final, "vllm:request_queue_time_seconds"),
            "kv_usage_mean": poller.mean("vllm:kv_cache_usage_perc"),
            "preemptions": final.get("nanoplug_preemptions_total"),
            "prefix_hit_rate": final.get("nanoplug_prefix_cache_hit_rate")}


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics, one value per metric name (labels dropped: the replicas are summed already)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def mean_of(metrics: dict[str, float], histogram: str) -> float | None:
    """A histogram's mean in milliseconds, from its _sum and _count."""
    count = metrics.get(histogram + "_count")
    return round(1e3 * metrics[histogram + "_sum"] / count, 1) if count else None


class MetricsPoller:
    """/metrics read every `every` seconds while the workload runs, for the gauges' means."""

    def __init__(self, url: str, every: float = 0.25):
        import threading

        self.samples: list[dict[str, float]] = []
        self.done = threading.Event()
        self.replicas: list[list[dict]] = []  # /health's per-replica open, running and waiting counts

        def poll():
            while not self.done.wait(every):
                try:
                    self.samples.append(scrape(url))
                    self.replicas.append(httpx.get(f"{url}/health", timeout=10).json().get("replicas", []))
                except httpx.HTTPError:
                    pass

        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def per_replica(self, field: str) -> list[float]:
        """Each replica's mean of a /health count over the run (where one replica idles while the other queues)."""
        rows = [r for r in self.replicas if r]
        if not rows:
            return []
        return [round(sum(r[i].get(field, 0) for r in rows) / len(rows), 2) for i in range(len(rows[0]))]

    def mean(self, name: str) -> float | None:
        values = [s[name] for s in self.samples if name in s]
        return round(sum(values) / len(values), 3) if values else None


def resolve_model(name: str | None) -> str:
    if name == "qwen3-0.6b-random":
        from nanoplug.bench.throughput import write_checkpoint

        return str(write_checkpoint())
    if name:
        return name
    from nanoplug.bench.checkpoints import write_random_checkpoint

    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "nanoplug-serve-dp-tiny"
    if not (folder / "config.json").exists():
        write_random_checkpoint(folder, "Qwen3ForCausalLM", seed=0)
    return str(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder or 'qwen3-0.6b-random' (default: a tiny random Qwen3)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=None, metavar="N:ROUTING",
                    help="configurations to run (default: 1:- N:round_robin N:prefix)")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=192)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=96, help="KV blocks per replica")
    ap.add_argument("--equal-memory", action="store_true",
                    help="give the one-engine configuration the N replicas' blocks together (default: one replica's)")
    ap.add_argument("--kv-block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--attention", default=None)
    ap.add_argument("--kv-cache", default=None)
    ap.add_argument("--vocab-low", type=int, default=100)
    ap.add_argument("--vocab-high", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-processes", type=int, default=None,
                    help="client processes sharing the concurrency (default: 1 on up to 4 cores, else 8). One "
                         "process of the openai client held only ~10 of 64 requests in an H100 server")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.client_processes is None:
        args.client_processes = 1 if (os.cpu_count() or 1) <= 4 else 8
    model = resolve_model(args.model)
    prompts, params = workload(args)
    configs = args.configs or ["1:-", f"{args.replicas}:round_robin", f"{args.replicas}:prefix"]
    rows = []
    for config in configs:
        n, _, routing = config.partition(":")
        row = run_config(args, model, int(n), routing or "prefix", prompts, params)
        rows.append(row)
        print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\nserve_dp: {args.requests} requests over {args.prefixes} prefixes of {args.prefix_len} tokens "
          f"(+{args.suffix_len}, {args.output_len} out), concurrency {args.concurrency}, {args.num_kv_blocks} KV blocks "
          f"of {args.kv_block_size} per replica, {args.client_processes} client process(es); {platform.machine()} "
          f"{os.cpu_count()} cores, commit {commit}")
    print(f"{'replicas':>8} {'routing':>12} {'tok/s':>9} {'req/s':>7} {'TTFT mean':>10} {'TTFT p50':>9} "
          f"{'front us/tok':>12} {'engine us/tok':>13} {'failed':>6} per replica")
    for r in rows:
        print(f"{r['replicas']:>8} {r['routing']:>12} {r['output_tok_per_s']:>9.1f} {r['requests_per_s']:>7.2f} "
              f"{r['ttft_mean_ms']:>8.0f}ms {r['ttft_p50_ms']:>7.0f}ms {r['front_end_cpu_us_per_token']:>12.0f} "
              f"{r['engine_cpu_us_per_token']:>13.0f} {r['failed']:>6} {r['per_replica']}")
        print(f"{'':>21} open {r['open_mean']}, running {r['running_mean']}, waiting {r['waiting_mean']}, "
              f"server TTFT {r['server_ttft_mean_ms']} ms (queued {r['queue_mean_ms']} ms), KV use {r['kv_usage_mean']}, "
              f"preemptions {r['preemptions']}, prefix hits {r['prefix_hit_rate']}, "
              f"served without text {r['no_text']}")
        if r["open_per_replica"]:
            print(f"{'':>21} per replica: open {r['open_per_replica']}, running {r['running_per_replica']}, "
                  f"waiting {r['waiting_per_replica']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
