"""`GET /metrics`: Prometheus text through prometheus-client, one registry per app (tests run several).

Engine figures (running, waiting, KV blocks, token totals) are read from the engine's latest stats at
scrape time by a collector, so the hot path pays nothing for them; the front end observes requests
by HTTP status, finish reasons, time to first token and inter-token latency as they happen.

Beside nanoplug's own names, the figures a scheduler reads carry vLLM's names (`vllm:...`, labelled
`model_name`), which the Gateway API Inference Extension's endpoint picker and llm-d scrape: waiting
and running requests, KV-cache usage as a ratio, the LoRA info gauge, prefix-cache queries and hits,
and the queue-time, end-to-end and first-token histograms (docs/serving.md walks the protocol).
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoplug.server.streams import RequestStream

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
# vLLM's buckets for request latencies (e2e, queue time), so dashboards built for it read ours
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1) + REQUEST_BUCKETS
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, stats: Callable[[], object], waiting_in_server: Callable[[], int], owner: "Metrics"):
        self.stats, self.waiting_in_server, self.owner = stats, waiting_in_server, owner

    def collect(self):
        s = self.stats()
        yield from self.owner.gateway_gauges(s)
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
    def __init__(self, stats: Callable[[], object], open_requests: Callable[[], int], model_name: str = "",
                 max_lora: Callable[[], int] = lambda: 0):
        self.model_name, self.max_lora = model_name, max_lora
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, open_requests, self))
        self.registry.register(_SpecDecodeCollector(stats))
        label = ["model_name"]
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      label, registry=self.registry).labels(model_name)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", label,
                                   registry=self.registry).labels(model_name)
        self.queries = self.hits = 0
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time a request waited in the engine's queue "
                                    "before its first step", label, buckets=QUEUE_BUCKETS,
                                    registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token", label,
                             buckets=REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token", label,
                                   buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.http = Counter("nanoplug_http_requests", "HTTP requests by route and status", ["route", "status"],
                            registry=self.registry)
        self.finished = Counter("nanoplug_request_finished", "Engine requests finished, by reason", ["finish_reason"],
                                registry=self.registry)
        self.ttft = Histogram("nanoplug_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("nanoplug_inter_token_latency_seconds", "Time between tokens of one request",
                             buckets=ITL_BUCKETS, registry=self.registry)

    def gateway_gauges(self, s: object):
        """The gauges the inference gateway's endpoint picker reads, under vLLM's names."""
        label = ["model_name"]
        for name, text, value in (
                ("vllm:num_requests_running", "Requests in the running batch", s.num_running),
                ("vllm:num_requests_waiting", "Requests waiting for a batch slot", s.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)",
                 s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
                ("nanoplug_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up, since start",
                 self.hits / self.queries if self.queries else 0.0)):
            gauge = GaugeMetricFamily(name, text, labels=label)
            gauge.add_metric([self.model_name], value)
            yield gauge
        max_lora = self.max_lora()
        if max_lora:  # as vLLM: only a server with adapters reports them; the value is when it was read
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([",".join(s.running_adapters), ",".join(s.waiting_adapters), str(max_lora)], time.time())
            yield info

    def on_first(self, stream: RequestStream, update: object) -> None:
        """A request's first update: its queue time and its prefix-cache hits."""
        if update.queue_time is not None:
            self.queue_time.observe(update.queue_time)
        self.queries += update.num_prompt_tokens
        self.hits += update.num_cached_tokens
        self.prefix_queries.inc(update.num_prompt_tokens)
        self.prefix_hits.inc(update.num_cached_tokens)

    def on_tokens(self, stream: RequestStream, count: int, now: float) -> None:
        if stream.first_token_at is None:
            self.ttft.observe(now - stream.arrived)
            self.vllm_ttft.observe(now - stream.arrived)
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
        if reason != "abort":
            self.e2e.observe(time.monotonic() - stream.arrived)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI middleware counting responses by route and status (pure ASGI, so streaming is untouched)."""

    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/",
              "/v1/load_lora_adapter", "/v1/unload_lora_adapter")

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
