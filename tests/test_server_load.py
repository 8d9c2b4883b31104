"""64 concurrent streaming clients against one server on a tiny model (CPU), two rounds.

Every request completes with the greedy text the engine gives for it alone; the requests really share
batches (/metrics shows at least 32 running at once); each stream's first chunk is sent before its
request finished; afterwards no KV block is in use and the server's memory has not grown.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import pytest

from _checkpoints import checkpoint
from _server import ENGINE, start_server
from nanoplug import LLM, SamplingParams

CLIENTS = 64
MAX_TOKENS = 32
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
# 16 distinct prompts of 5-15 tokens, each sent by 4 clients (the reference runs each alone: 16 runs, not 64)
DISTINCT = [f"Request {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 11)) for i in range(16)]
PROMPTS = [DISTINCT[i % len(DISTINCT)] for i in range(CLIENTS)]
RSS_SLACK = 16 << 20  # allocator noise; a leak of per-request state over 64 requests would exceed it


@pytest.fixture(scope="module")
def server(request):
    return start_server(request)


@pytest.fixture(scope="module")
def expected():
    """Each prompt's greedy text from `LLM.generate`, one prompt at a time."""
    with LLM(checkpoint("qwen3"), **ENGINE) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        alone = {p: llm.generate([p], params, use_tqdm=False)[0].text for p in DISTINCT}
    return [alone[p] for p in PROMPTS]


async def _one(client, prompt: str) -> dict:
    stream = await client.completions.create(model=checkpoint("qwen3"), prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True)
    pieces, reasons = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
    return {"text": "".join(pieces), "reasons": reasons}


async def _watch_running(url: str, done: asyncio.Event, peaks: list[float]) -> None:
    async with httpx.AsyncClient() as http:
        while not done.is_set():
            text = (await http.get(f"{url}/metrics")).text
            for line in text.splitlines():
                if line.startswith("nanoplug_num_requests_running "):
                    peaks.append(float(line.split()[1]))
            await asyncio.sleep(0.02)


async def _round(server) -> tuple[list[dict], float]:
    client = server.async_client(timeout=120)
    done, peaks = asyncio.Event(), []
    watcher = asyncio.create_task(_watch_running(server.url, done, peaks))
    try:
        results = await asyncio.gather(*(_one(client, p) for p in PROMPTS))
    finally:
        done.set()
        await watcher
        await client.close()
    return results, max(peaks, default=0)


def _rss(pid: int) -> int:
    """The server's memory: its process and the engine process it started."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in (process, *process.children()))


def test_64_concurrent_streams(server, expected):
    rss = []
    for round_ in range(2):
        t = time.monotonic()
        results, peak = asyncio.run(_round(server))
        seconds = time.monotonic() - t
        for i, (got, want) in enumerate(zip(results, expected)):
            assert got["text"] == want, f"round {round_}, request {i}: {got['text']!r} != {want!r}"
            assert got["reasons"][-1] in ("length", "stop")
            assert got["reasons"][0] is None and len(got["reasons"]) > 1, f"request {i} was not streamed: {got}"
        assert peak >= 32, f"at most {peak} requests ran at once"
        metrics = server.wait_idle()
        assert metrics["nanoplug_kv_blocks_used"] == 0
        rss.append(_rss(server.pid))
        print(f"round {round_}: {CLIENTS} streams in {seconds:.1f} s, peak running {peak:.0f}, rss {rss[-1] >> 20} MiB")
    assert rss[1] <= rss[0] + RSS_SLACK, f"server memory grew from {rss[0] >> 20} to {rss[1] >> 20} MiB"
