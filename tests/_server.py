"""A real `nanoplug serve` process on 127.0.0.1 for the server tests, and what they read from it.

`--port 0` lets the server pick a free port and print it (no fixed port, no race). The process runs
in its own process group, and `stop()` (which the fixtures' finalizers always call) kills the group.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from _checkpoints import checkpoint

API_KEY = "test-key-123"
# small KV pages so 64 requests fit in a small pool; the same options build the reference LLM
ENGINE = dict(kv_block_size=16, num_kv_blocks=512, max_model_len=512, max_num_seqs=64)


def engine_args(options: dict) -> list[str]:
    args = []
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


class ServerProcess:
    def __init__(self, *extra: str, model: str | None = None, api_key: str | None = API_KEY,
                 engine: dict | None = None, timeout: float = 180):
        self.model = model or checkpoint("qwen3")
        args = [sys.executable, "-m", "nanoplug", "serve", "--model", self.model, "--port", "0",
                *engine_args(engine or ENGINE), *extra]
        if api_key:
            args += ["--api-key", api_key]
        self.api_key = api_key
        self.lines: list[str] = []
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, cwd=Path(__file__).resolve().parent.parent,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.timeout = timeout
        self.url = ""

    def wait_ready(self) -> "ServerProcess":
        self.url = self._wait_for_url(self.timeout)
        self._wait_healthy(self.timeout)
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", self.output)
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output}")
            time.sleep(0.05)
        raise TimeoutError(f"the server did not start within {timeout} s:\n{self.output}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"/health did not answer within {timeout} s:\n{self.output}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, plus labelled ones as 'name{labels}'."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 10) -> dict[str, float]:
        """Wait until no request is open and no KV block is in use; returns the last metrics read."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["nanoplug_kv_blocks_used"] == 0 and m["nanoplug_num_requests_open"] == 0 \
                    and m["nanoplug_num_requests_running"] == 0 and m["nanoplug_num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout} s: {m}")
            time.sleep(0.02)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        """Kill the whole process group (the server and anything it started); safe to call twice."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=5)


def start_server(request, *extra: str, **kw) -> ServerProcess:
    """A server whose process group is killed when the requesting fixture is finalized, whatever happens."""
    holder: list[ServerProcess] = []

    def finalize():
        for server in holder:
            server.stop()

    request.addfinalizer(finalize)
    server = ServerProcess(*extra, **kw)
    holder.append(server)
    return server.wait_ready()
