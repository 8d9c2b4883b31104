"""Serving the app with uvicorn on a socket we bind ourselves, with a clean shutdown on SIGINT/SIGTERM.

Binding first lets `--port 0` pick a free port and say which (tests never fix one). On a signal the
server stops taking connections, every open request gets a final error event and is aborted (its KV
blocks freed), the streams end, and only then does uvicorn wait for connections and stop the engine,
so nothing hangs; a second Ctrl-C still forces the exit.
"""
from __future__ import annotations

import logging
import socket
import sys
from types import FrameType

import uvicorn

from nanoplug.server.app import ServerSettings, build_app

log = logging.getLogger("nanoplug.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.nanoplug = state
        self.exit_code = 0
        state.request_exit = self.exit_with

    def exit_with(self, code: int) -> None:
        """Stop serving (on the loop's thread) and have `serve` return `code`."""
        self.exit_code = code
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = getattr(self.nanoplug, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.nanoplug.begin_shutdown)  # safe from a signal handler
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port (0: any free one)") from exc
    sock.set_inheritable(True)
    return sock


def serve(engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000, access_log: bool = False,
          log_level: str = "warning") -> int:
    """Serve until a signal (returns 0) or the engine's death (returns 1 unless restarted); `engine` is loaded
    already (EngineProcess, or EngineLoop with --single-process)."""
    sock = bind(host, port)
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{sock.getsockname()[1]}"
    app = build_app(engine, settings)
    state = app.state.nanoplug
    state.on_ready = lambda: print(f"nanoplug: serving {settings.model_name} on {url} (chat page: {url}/)",
                                   file=sys.stderr, flush=True)
    try:
        from nanoplug.server.http import guarded_protocol

        http = guarded_protocol(settings.header_timeout_s, settings.max_header_bytes)
    except ImportError:  # no httptools: h11 bounds the headers' size (not their time)
        http = "h11"
    config = uvicorn.Config(app, access_log=access_log, log_level=log_level, lifespan="on", http=http,
                            h11_max_incomplete_event_size=settings.max_header_bytes,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5)
    server = _Server(config, state)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.stop()  # idempotent: the lifespan stopped it unless start-up failed
    return server.exit_code
