"""Load generator for `nanoplug serve`: requests/s, output tok/s, TTFT and ITL at several concurrencies,
with the offline `nanoplug bench` figure of the same requests beside them.

The requests are BENCHMARK.md's workload (`nanoplug.bench.throughput.workload`: random token-id prompts of
100..max_input_len tokens, temperature 0.6, eos ignored, 100..max_output_len new tokens), sent as
streaming `/v1/completions` by the official async `openai` client. At concurrency C, C workers send
max(C, --min-requests) requests; at C = 256 these are exactly `nanoplug bench`'s 256 requests.

Per request: TTFT = send to first streamed token; TPOT = (last token - first token) / (tokens - 1);
ITL = the gaps between consecutive streamed events (an event may carry several tokens when the
client reads slower than the engine steps, so ITL is per event, as vLLM's benchmark counts it).

    python benchmarks/serve.py                                  # CPU: the embedded default model
    python benchmarks/serve.py --model qwen3-0.6b-random --concurrency 1 16 64 256 \\
        --max-input-len 1024 --max-output-len 1024 --attention flash --kv-cache triton    # the H200 run
    python benchmarks/serve.py --single-process ...             # engine core in a thread of the server
    python benchmarks/serve.py --url http://127.0.0.1:8000 --model NAME   # a server already running

Without --url it starts `nanoplug serve` itself on a free port (and stops it), then runs the offline
figure in this process after the server is gone, so the two never share the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's nanoplug, not an installed one

ENGINE_FLAGS = ("device", "dtype", "attention", "kv_cache", "max_model_len", "max_num_seqs", "num_kv_blocks",
                "kv_block_size", "cpu_kv_cache_gb")


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0  # seconds
    tpot: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""
    no_text: bool = False  # served, but every token's text was empty (its first token's time is its end)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_request(client, model: str, prompt: list[int], params) -> Result:
    start = time.perf_counter()
    times = []
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": params.ignore_eos})
        tokens, ended = 0, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            if chunk.choices and chunk.choices[0].finish_reason:
                ended = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # counted and reported, never hidden
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    if not times and tokens and ended is not None:  # tokens whose text is empty (a random model's special tokens):
        return Result(True, ended - start, 0.0, [], tokens, no_text=True)  # served; its first text came with its end
    if not times:
        return Result(False, error=f"no token streamed ({tokens} completion tokens)")
    gaps = [b - a for a, b in zip(times, times[1:])]
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else 0.0
    return Result(True, times[0] - start, tpot, gaps, tokens)


async def drive(url: str, api_key: str, model: str, concurrency: int, prompts, params) -> tuple[list[Result], float, float]:
    """`concurrency` workers send the requests in turn; returns the results and the wall-clock start and end."""
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=3600,
                         http_client=httpx.AsyncClient(limits=limits, timeout=3600))
    queue: asyncio.Queue = asyncio.Queue()
    for item in zip(prompts, params):
        queue.put_nowait(item)
    results: list[Result] = []

    async def worker():
        while not queue.empty():
            prompt, p = queue.get_nowait()
            results.append(await one_request(client, model, prompt, p))

    start = time.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    end = time.time()
    await client.close()
    return results, start, end


def drive_json(job: str) -> str:
    """One client process's share of a level (JSON in and out)."""
    from nanoplug import SamplingParams

    j = json.loads(job)
    params = [SamplingParams(**p) for p in j["params"]]
    results, start, end = asyncio.run(drive(j["url"], j["api_key"], j["model"], j["concurrency"], j["prompts"], params))
    return json.dumps({"results": [r.__dict__ for r in results], "start": start, "end": end})


def drive_spread(url: str, api_key: str, model: str, concurrency: int, prompts, params, processes: int
                 ) -> tuple[list[Result], float, float]:
    """`drive` with the clients spread over `processes` processes: one Python client process parses some 10,000
    events/s, less than a GPU server sends at high concurrency, and the openai client spends ~10-20 ms building
    each request of a 2,000-token id prompt (its transform walks every id)."""
    processes = max(1, min(processes, concurrency))
    if processes == 1:
        return asyncio.run(drive(url, api_key, model, concurrency, prompts, params))
    from concurrent.futures import ProcessPoolExecutor

    jobs = [json.dumps({"url": url, "api_key": api_key, "model": model,
                        "concurrency": len(range(k, concurrency, processes)), "prompts": prompts[k::processes],
                        "params": [p.model_dump() for p in params[k::processes]]}) for k in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        shares = [json.loads(out) for out in pool.map(drive_json, jobs)]
    results = [Result(**r) for share in shares for r in share["results"]]
    return results, min(s["start"] for s in shares), max(s["end"] for s in shares)


def run_level(url: str, api_key: str, model: str, concurrency: int, prompts, params, processes: int) -> dict:
    """One concurrency level, its clients spread over `processes` processes (`drive_spread`)."""
    results, start, end = drive_spread(url, api_key, model, concurrency, prompts, params, processes)
    seconds = end - start
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3], "seconds": seconds,
        "requests_per_s": len(ok) / seconds, "output_tok_per_s": tokens / seconds, "output_tokens": tokens,
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in ok], 0.5), "ttft_p99_ms": 1e3 * percentile([r.ttft for r in ok], 0.99),
        "tpot_p50_ms": 1e3 * percentile([r.tpot for r in ok], 0.5), "tpot_p99_ms": 1e3 * percentile([r.tpot for r in ok], 0.99),
        "itl_p50_ms": 1e3 * percentile(gaps, 0.5), "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
    }


# ---------------------------------------------------------------------------- the server process
class Server:
    """`nanoplug serve` on a free port, in its own process group, stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, args, model: str, extra: tuple[str, ...] = ()):
        cmd = [sys.executable, "-m", "nanoplug", "serve", "--model", model, "--port", "0",
               "--max-waiting", str(max(args.concurrency) + 16), *extra]
        for name in ENGINE_FLAGS:
            value = getattr(args, name)
            if value is not None:
                cmd += [f"--{name.replace('_', '-')}", str(value)]
        if args.single_process:
            cmd.append("--single-process")
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.log: list[str] = []
        found = threading.Event()
        self.url = ""

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"serving .* on (http://\S+) ", line)
                if m:
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        found.wait(timeout=1800)
        if not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))

    def cpu_seconds(self) -> tuple[float, float]:
        """(front end, engine) CPU seconds so far: the server process and its engine processes (all replicas'); with
        --single-process, the main thread (uvicorn's event loop) and every other thread (the stepping
        thread, torch's workers, tokenizing)."""
        import psutil

        server = psutil.Process(self.proc.pid)
        children = server.children()
        if children:
            t, cs = server.cpu_times(), [c.cpu_times() for c in children]
            return t.user + t.system, sum(c.user + c.system for c in cs)
        threads = server.threads()
        front = sum(t.user_time + t.system_time for t in threads if t.id == server.pid)
        return front, sum(t.user_time + t.system_time for t in threads if t.id != server.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def resolve_model(name: str | None) -> str:
    if name is None:
        from nanoplug.checkpoint.default_model import default_model_path

        return str(default_model_path(progress=True))
    if name == "qwen3-0.6b-random":
        from nanoplug.bench.throughput import write_checkpoint

        return str(write_checkpoint())
    return name


def offline(args, model: str, prompts, params) -> dict:
    """`nanoplug bench`'s figure for the same requests: one `LLM.generate`, after an untimed warm-up."""
    from nanoplug import LLM, SamplingParams

    options = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if "cpu_kv_cache_gb" in options:
        options["cpu"] = {"kv_cache_gb": options.pop("cpu_kv_cache_gb")}
    if args.enforce_eager:
        options["cuda"] = {"enforce_eager": True}
    with LLM(model, **options) as llm:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"requests": len(prompts), "seconds": seconds, "output_tokens": tokens, "output_tok_per_s": tokens / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--api-key", default=os.environ.get("NANOPLUG_API_KEY", "none"))
    ap.add_argument("--model", default=None,
                    help="checkpoint folder, 'qwen3-0.6b-random' (BENCHMARK.md's), or with --url the served name "
                         "(default: the embedded default model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--min-requests", type=int, default=16, help="requests at each level at least (default: 16)")
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=None,
                    help="override the workload's 0.6 (0: greedy; on CPU the sampler's noise can dominate a tiny model's step)")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="spread the clients over this many processes (use several at high concurrency on a GPU)")
    ap.add_argument("--single-process", action="store_true", help="start the server with --single-process")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline figure")
    ap.add_argument("--offline-only", type=int, default=None, metavar="N",
                    help="only the offline figure, for the first N requests of the same workload")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    for name in ENGINE_FLAGS:
        ap.add_argument(f"--{name.replace('_', '-')}", default=None,
                        type=float if name == "cpu_kv_cache_gb" else int if name.startswith(("max_", "num_", "kv_b")) else str)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()

    from nanoplug.bench.throughput import workload

    largest = max(max(args.concurrency), args.min_requests)
    prompts, params = workload(largest, args.max_input_len, args.max_output_len)
    if args.temperature is not None:
        params = [p.model_copy(update={"temperature": args.temperature}) for p in params]
    model = args.model if args.url else resolve_model(args.model)
    if args.offline_only:
        off = offline(args, model, prompts[:args.offline_only], params[:args.offline_only])
        print(f"offline (nanoplug bench, {off['requests']} requests): {off['output_tok_per_s']:,.1f} output tok/s "
              f"in {off['seconds']:.1f} s", flush=True)
        return 0
    server = None if args.url else Server(args, model)
    url = args.url or server.url
    served = args.model if args.url else model
    levels = []
    try:
        for c in args.concurrency:
            n = max(c, args.min_requests)
            cpu_before = server.cpu_seconds() if server else None
            level = run_level(url, args.api_key, served, c, prompts[:n], params[:n], args.client_processes)
            if server:
                front, engine = (after - before for after, before in zip(server.cpu_seconds(), cpu_before))
                tokens = max(level["output_tokens"], 1)
                level.update(front_end_cpu_s=front, engine_cpu_s=engine,
                             front_end_cpu_us_per_token=1e6 * front / tokens, engine_cpu_us_per_token=1e6 * engine / tokens)
            levels.append(level)
            print(f"concurrency {c:>4}: {level['requests']} requests ({level['failed']} failed) in {level['seconds']:.1f} s, "
                  f"{level['requests_per_s']:.2f} req/s, {level['output_tok_per_s']:,.0f} output tok/s, "
                  f"TTFT p50 {level['ttft_p50_ms']:.0f} / p99 {level['ttft_p99_ms']:.0f} ms, "
                  f"TPOT p50 {level['tpot_p50_ms']:.1f} / p99 {level['tpot_p99_ms']:.1f} ms, "
                  f"ITL p50 {level['itl_p50_ms']:.1f} / p99 {level['itl_p99_ms']:.1f} ms"
                  + (f"; server CPU per output token: front end {level['front_end_cpu_us_per_token']:.0f} us, "
                     f"engine {level['engine_cpu_us_per_token']:.0f} us" if server else "")
                  + (f"; errors: {level['errors']}" if level["failed"] else ""), flush=True)
    finally:
        if server is not None:
            server.stop()
    report = {"model": served, "machine": f"{platform.machine()} {os.cpu_count()} cores", "levels": levels,
              "single_process": args.single_process, "workload": vars(args)}
    if not args.no_offline and not args.url:
        n = max(args.concurrency[-1], args.min_requests)
        report["offline"] = off = offline(args, model, prompts[:n], params[:n])
        print(f"offline (nanoplug bench, same {off['requests']} requests): {off['output_tok_per_s']:,.0f} output tok/s "
              f"in {off['seconds']:.1f} s; the server at concurrency {args.concurrency[-1]} keeps "
              f"{levels[-1]['output_tok_per_s'] / off['output_tok_per_s']:.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(level["failed"] for level in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
