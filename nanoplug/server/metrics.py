"""`GET /metrics`: Prometheus text through prometheus-client, one registry per app (tests run several).

Engine figures (running, waiting, KV blocks, token totals) are read from the engine's latest stats at
scrape time by a collector, so the hot path pays nothing for them; the front end observes requests
by HTTP status, finish reasons, time to first token and inter-token latency as they happen.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoplug.server.streams import RequestStream

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, stats: Callable[[], object], waiting_in_server: Callable[[], int]):
        self.stats, self.waiting_in_server = stats, waiting_in_server

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("nanoplug_num_requests_running", "Requests in the running batch", value=s.num_running)
        yield GaugeMetricFamily("nanoplug_num_requests_waiting", "Requests admitted, waiting for a batch slot",
                                value=s.num_waiting)
        yield GaugeMetricFamily("nanoplug_num_requests_open", "Requests the server holds (running, waiting or queued)",
                                value=self.waiting_in_server())
        yield GaugeMetricFamily("nanoplug_kv_blocks_used", "KV-cache blocks in use", value=s.kv_blocks_used)
        yield GaugeMetricFamily("nanoplug_kv_blocks_total", "KV-cache blocks", value=s.kv_blocks_total)
        yield CounterMetricFamily("nanoplug_preemptions", "Sequences preempted for lack of KV blocks",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("nanoplug_prompt_tokens", "Prompt tokens of admitted requests",
                                  value=s.prompt_tokens_total)
        yield CounterMetricFamily("nanoplug_generation_tokens", "Tokens generated", value=s.generated_tokens_total)


class _SpecDecodeCollector:
    """Speculative decoding (vLLM's spec_decode metrics): drafts proposed and kept, verifications, and the
    two figures they give, the acceptance rate and the mean accepted length (tokens per verification)."""

    def __init__(self, stats: Callable[[], object]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        drafts, accepted, verified = s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verifications
        yield CounterMetricFamily("nanoplug_spec_decode_num_drafts", "Sequence-steps that verified draft tokens",
                                  value=verified)
        yield CounterMetricFamily("nanoplug_spec_decode_num_draft_tokens", "Draft tokens proposed", value=drafts)
        yield CounterMetricFamily("nanoplug_spec_decode_num_accepted_tokens", "Draft tokens accepted", value=accepted)
        yield GaugeMetricFamily("nanoplug_spec_decode_acceptance_rate", "Accepted over proposed draft tokens",
                                value=accepted / drafts if drafts else 0.0)
        yield GaugeMetricFamily("nanoplug_spec_decode_mean_accepted_length",
                                "Tokens a verification gives: its accepted drafts plus one",
                                value=1.0 + accepted / verified if verified else 0.0)


class Metrics:
    def __init__(self, stats: Callable[[], object], open_requests: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, open_requests))
        self.registry.register(_SpecDecodeCollector(stats))
        self.http = Counter("nanoplug_http_requests", "HTTP requests by route and status", ["route", "status"],
                            registry=self.registry)
        self.finished = Counter("nanoplug_request_finished", "Engine requests finished, by reason", ["finish_reason"],
                                registry=self.registry)
        self.ttft = Histogram("nanoplug_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("nanoplug_inter_token_latency_seconds", "Time between tokens of one request",
                             buckets=ITL_BUCKETS, registry=self.registry)

    def on_tokens(self, stream: RequestStream, count: int, now: float) -> None:
        if stream.first_token_at is None:
            self.ttft.observe(now - stream.arrived)
            count -= 1
            last = now
        else:
            last = stream.last_token_at
        if count > 0:
            gap = (now - last) / count
            for _ in range(count):
                self.itl.observe(gap)

    def on_finish(self, stream: RequestStream, reason: str | None) -> None:
        self.finished.labels(reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI middleware counting responses by route and status (pure ASGI, so streaming is untouched)."""

    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/")

    def __init__(self, app, metrics: Callable[[], Metrics | None]):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in self.ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                metrics = self.metrics()
                if metrics is not None:
                    metrics.http.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
