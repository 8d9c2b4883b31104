"""The FastAPI app: routes, the API key and body limit (guard.py), admission (a bounded queue), metrics and the chat page.

`build_app(engine, settings)` takes an engine that is already loaded (so a bad model fails before a
port is bound); the app's lifespan starts its stepping and stops it. Handlers never block the event
loop: tokenizing runs beside it, the engine steps in its own thread (or process), and results come
back as `RequestStream`s.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response

from nanoplug.server import api, lora_routes
from nanoplug.server.errors import APIError, install_handlers
from nanoplug.server.guard import Guard
from nanoplug.server.metrics import Metrics, StatusCounter
from nanoplug.server.streams import Streams

log = logging.getLogger("nanoplug.server")


@dataclass
class ServerSettings:
    model_name: str  # what /v1/models lists and requests must name
    adapters: dict[str, str] = field(default_factory=dict)  # per-request LoRA adapters at start: model name -> folder
    allow_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    api_key: str | None = None
    max_waiting: int = 1024  # requests queued beyond the engine's max_num_seqs before 503
    max_body_bytes: int = 4 << 20  # a larger body is a 413 before it is read whole
    max_prompts: int = 1024  # prompts in one completions request
    max_header_bytes: int = 64 << 10  # request line and headers (431 past it)
    header_timeout_s: float = 10.0  # for a request's headers to arrive (408 past it)
    metrics_require_key: bool = False  # /metrics behind the API key too
    restart_engine: int = 0  # engine restarts allowed after it dies (0: exit non-zero, for a supervisor)
    retry_after_s: int = 1
    shutdown_grace_s: float = 5.0  # how long streams get to send their final error event on shutdown


class ServerState:
    """What the handlers share: the engine, its open streams, the metrics, and admission."""

    def __init__(self, engine: Any, streams: Streams, metrics: Metrics, settings: ServerSettings):
        self.engine, self.streams, self.metrics, self.settings = engine, streams, metrics, settings
        self.closing = False
        self.reserved = 0  # slots promised to handlers still tokenizing
        self.capacity = engine.max_num_seqs + settings.max_waiting
        self.started = time.time()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_ready = lambda: None
        self.request_exit = lambda code: None  # set by launch.py: stop serving, exit with `code`
        self.restarts = 0
        self.adapters = dict(settings.adapters)  # the adapters served now (model name -> folder)
        self.adapter_lock = asyncio.Lock()
        engine.on_death = self.engine_died

    def engine_died(self, reason: str | None) -> None:
        """Open requests were failed already; restart the engine (--restart-engine, bounded) or exit non-zero
        so that a supervisor (systemd, Kubernetes) restarts the server, as vLLM does."""
        if self.closing:
            return
        if self.restarts < self.settings.restart_engine:
            self.restarts += 1
            log.error("the engine died (%s); restarting it (%d of %d)", reason, self.restarts,
                      self.settings.restart_engine)
            self._restart_task = asyncio.get_running_loop().create_task(self._restart())
            return
        log.error("the engine died (%s); the server exits so that its supervisor can restart it%s", reason,
                  " (restarts used up)" if self.settings.restart_engine else " (--restart-engine N restarts it here)")
        self.begin_shutdown()
        self.request_exit(1)

    async def _restart(self) -> None:
        try:
            await self.engine.restart()
            log.warning("the engine is serving again")
        except Exception:  # noqa: BLE001 (a model that no longer loads: exit, as without restarts)
            log.exception("restarting the engine failed; the server exits")
            self.begin_shutdown()
            self.request_exit(1)

    def admit(self, count: int) -> "_Reservation":
        """Room for `count` more engine requests, or a 503 with Retry-After (the queue is bounded)."""
        if self.closing:
            raise APIError(503, "the server is shutting down; retry against another instance", type="server_error",
                           code="shutting_down")
        held = len(self.streams) + self.reserved
        if held + count > self.capacity:
            raise APIError(503, f"the server is at capacity ({held} requests running or queued, limit {self.capacity}); "
                           f"retry after {self.settings.retry_after_s} s", type="server_error", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return _Reservation(self, count)

    def begin_shutdown(self) -> None:
        """SIGINT/SIGTERM: refuse new work, end every open request with an error event, free its blocks."""
        if self.closing:
            return
        self.closing = True
        open_ids = list(self.streams.open)
        log.warning("shutting down: %d open request(s) end with an error", len(open_ids))
        for request_id in open_ids:
            self.engine.abort(request_id)
        self.streams.fail_all(APIError(503, "the server is shutting down; the request was stopped",
                                       type="server_error", code="shutting_down"))


class _Reservation:
    def __init__(self, state: ServerState, count: int):
        self.state, self.count = state, count
        state.reserved += count

    def __enter__(self) -> "_Reservation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.state.reserved -= self.count


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    streams = engine.streams
    metrics = Metrics(lambda: engine.stats, lambda: len(streams), settings.model_name,
                      lambda: getattr(engine, "max_lora", 0))
    streams.on_tokens, streams.on_finish, streams.on_first = metrics.on_tokens, metrics.on_finish, metrics.on_first
    state = ServerState(engine, streams, metrics, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        engine.start(state.loop)
        state.on_ready()
        try:
            yield
        finally:
            state.begin_shutdown()
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    # no redirect on a trailing slash: it would echo the client's Host header in its location
    app = FastAPI(title="nanoplug", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.router.redirect_slashes = False
    app.state.nanoplug = state
    install_handlers(app)
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       metrics_require_key=settings.metrics_require_key)
    app.add_middleware(StatusCounter, metrics=lambda: metrics)  # added last: outermost, so it counts 401s and 413s

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return JSONResponse({"status": "error", "error": engine.failure}, status_code=503)
        if state.closing:  # load balancers stop sending here
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if hasattr(engine, "health"):  # data-parallel replicas: one dead is a degraded server, still serving
            replicas = engine.health()
            return {"status": "ok" if all(r["status"] == "ok" for r in replicas) else "degraded", "replicas": replicas}
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        """The base model, then each adapter with its `parent` (vLLM's shape: `root` is the adapter's folder)."""
        card = dict(object="model", created=int(state.started), owned_by="nanoplug", max_model_len=engine.max_model_len)
        base = settings.model_name
        return {"object": "list", "data": [{"id": base, "root": base, "parent": None, **card}] + [
            {"id": name, "root": path, "parent": base, **card} for name, path in state.adapters.items()]}

    page = resources.files("nanoplug.server").joinpath("static/chat.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(page)

    api.add_routes(app, state)
    lora_routes.add_routes(app, state)
    return app
