"""The engine core in a process of its own (the default of `nanoplug serve`), talking msgpack over a
socket pair: the layout vLLM chose so that the HTTP front end's work never takes the scheduler's GIL.

Why two processes, measured (benchmarks/RESULTS.md, "One process or two"): the front end costs
50-90 us of CPU per streamed token (parsing, SSE framing, uvicorn's writes), and in one process that
time is taken from the engine's interpreter. On 2 CPU cores with a tiny model at 64 concurrent
streams the split cut the front end's CPU per token from 73-88 to 48-52 us and lowered the median
time to first token in every alternated pair, at equal throughput; on a GPU, where a decode step of
256 sequences takes ~8 ms of which the host needs ~1.5, 256 events per step of front-end work would
otherwise compete for the same GIL as the step's launch, so there the split is what keeps the
server near the offline throughput. `--single-process` (engine_loop.py) keeps the other layout.

Wire format: frames of a 4-byte big-endian length and a msgspec msgpack body, decoded into the typed
structs below and nothing else: never pickle, whose decoding runs code chosen by whoever writes to
the socket (the bug class behind vLLM's and SGLang's ZMQ advisories). The socket is an unnamed
`socketpair` inherited by the child, so nothing else on the machine can reach it. Sampling
parameters travel as plain dicts and are validated again by SamplingParams on the engine side.

The front end (`EngineProcess`) has the same surface as `EngineLoop`: submit, abort, stats, streams.
The child (`main`) steps its core with the engine's `Driver` and prepares requests with `prepare_all`,
as the in-process layout does.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from typing import Any, Union

import msgspec

from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.errors import AdapterError, ModelLoadError, NanoplugError, RequestError
from nanoplug.server.errors import APIError
from nanoplug.server.prepare import PromptChoices, prepare_all
from nanoplug.server.render import token_texts
from nanoplug.server.streams import RequestStream, Streams
from nanoplug.server.tools import model_tool_call_format

log = logging.getLogger("nanoplug.server")
_HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20


# --------------------------------------------------------------------------------- the messages
class Stats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prompt_tokens_total: int
    generated_tokens_total: int
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    running_adapters: list[str] = []
    waiting_adapters: list[str] = []


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The engine's TokenLogprobs on the wire (same attribute names, so render.py reads either)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class Update(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Union[str, None]
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: Union[list[TokenLogprobs], None] = None
    prompt_logprobs: Union[list[Union[TokenLogprobs, None]], None] = None
    queue_time: Union[float, None] = None


class Start(msgspec.Struct, tag="start", array_like=True):
    config: dict[str, Any]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    stats: Stats
    max_lora: int = 0  # adapters served per request


class Prompt(msgspec.Struct, array_like=True):
    """One of: text, token ids, chat messages."""

    text: Union[str, None] = None
    token_ids: Union[list[int], None] = None
    messages: Union[list[dict[str, Any]], None] = None  # (Any: tool calls in the history)
    tools: Union[list[dict[str, Any]], None] = None

    @classmethod
    def of(cls, prompt: Any) -> "Prompt":
        if isinstance(prompt, str):
            return cls(text=prompt)
        if isinstance(prompt, dict):  # a conversation with tools
            return cls(messages=prompt["messages"], tools=prompt.get("tools"))
        if prompt and isinstance(prompt[0], dict):
            return cls(messages=prompt)
        return cls(token_ids=prompt)

    def value(self) -> Any:
        if self.tools is not None:
            return {"messages": self.messages, "tools": self.tools}
        return self.text if self.text is not None else self.messages if self.messages is not None else self.token_ids


class Add(msgspec.Struct, tag="add", array_like=True):
    token: int
    items: list[tuple[Prompt, list[tuple[str, dict[str, Any]]]]]
    fill_context: bool
    want_prompt_ids: bool = False  # answer with each prompt's token ids (echo with logprobs)


class Accepted(msgspec.Struct, tag="accepted", array_like=True):
    token: int
    prompt_token_ids: Union[list[list[int]], None] = None


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    token: int
    message: str


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class LoadAdapter(msgspec.Struct, tag="load_adapter", array_like=True):
    """Load (path given) or unload (path None) a per-request adapter; answered by Accepted or Rejected."""

    token: int
    name: str
    path: Union[str, None] = None


class Stepped(msgspec.Struct, tag="stepped", array_like=True):
    updates: list[Update]
    stats: Stats


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str


Message = Union[Start, Ready, Add, Accepted, Rejected, Abort, LoadAdapter, Stepped, Failed]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def frame(message: Any) -> bytes:
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


def _stats(s: Any) -> Stats:
    return Stats(s.num_running, s.num_waiting, s.kv_blocks_used, s.kv_blocks_total, s.num_preemptions,
                 s.prompt_tokens_total, s.generated_tokens_total, s.spec_draft_tokens, s.spec_accepted_tokens,
                 s.spec_verifications, s.running_adapters, s.waiting_adapters)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> Any | None:
    """One message from a blocking socket; None at end of stream."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes is over the limit of {MAX_FRAME}")
    body = _recv_exactly(sock, size)
    return None if body is None else _decoder.decode(body)


# ------------------------------------------------------------------------------ the front end
class EngineProcess:
    """Starts the engine process and waits until its model is loaded (a load error is raised here).

    As one replica of several (server/replicas.py): `streams` is the front end's, shared, `owner` marks this
    replica's streams, `label` names it in errors, `env` is what its process gets on top of ours (its GPU, its
    cores); when it dies only its own requests fail, with a 503 naming it."""

    def __init__(self, config: EngineConfig, startup_timeout: float = 1800, streams: Streams | None = None,
                 owner: int = 0, label: str | None = None, env: dict[str, str] | None = None):
        self.config, self.startup_timeout = config, startup_timeout
        self.owner, self.label, self.env = owner, label, env
        self.streams = streams if streams is not None else Streams()
        self.failure: str | None = None
        self.on_death = lambda reason: None  # the app's: restart or exit (app.py)
        self._pending: dict[int, asyncio.Future] = {}
        self._tokens = count()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._closing = False
        self._spawn()
        self.tokenizer = _tokenizer(config.model)  # echo's text and logprobs' token strings are written here
        self.token_text = token_texts(self.tokenizer)
        # its model plugin's format that its chat template writes (server/tools.py)
        self.tool_call_format = model_tool_call_format(config.model, getattr(self.tokenizer, "chat_template", None))

    def _spawn(self) -> None:
        """A new engine process, its model loaded (blocking)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoplug.server.engine_process", str(child.fileno())],
                                     pass_fds=[child.fileno()], env={**os.environ, **self.env} if self.env else None)
        child.close()
        self._sock = parent
        parent.sendall(frame(Start(self.config.model_dump(mode="json", exclude_unset=True))))
        parent.settimeout(self.startup_timeout)
        first = recv_message(parent)
        parent.settimeout(None)
        if isinstance(first, Failed):
            self.stop()
            raise ModelLoadError(first.message)
        if not isinstance(first, Ready):
            self.stop()
            raise RuntimeError(f"the engine process exited during start-up (exit code {self.proc.poll()})")
        self.max_model_len, self.max_num_seqs, self.stats = first.max_model_len, first.max_num_seqs, first.stats
        self.vocab_size, self.max_lora = first.vocab_size, first.max_lora

    async def restart(self) -> None:
        """After the engine process died: a new one, serving again once its model is loaded."""
        old_sock, old_proc = self._sock, self.proc
        self._closing = True
        if self._reader_task is not None:
            self._reader_task.cancel()
        if old_proc.poll() is None:
            old_proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, old_proc.wait)
        old_sock.close()
        await asyncio.get_running_loop().run_in_executor(None, self._spawn)
        self._closing = False
        self._pending.clear()
        self.start(asyncio.get_running_loop())
        await self._started.wait()
        self.failure = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._started = asyncio.Event()
        self._reader_task = loop.create_task(self._serve())

    async def _serve(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        self._started.set()
        try:
            while True:
                size = _HEADER.unpack(await reader.readexactly(_HEADER.size))[0]
                message = _decoder.decode(await reader.readexactly(size))
                if isinstance(message, Stepped):
                    self.stats = message.stats
                    if message.updates:
                        self.streams.deliver(message.updates)
                elif isinstance(message, (Accepted, Rejected)):
                    future = self._pending.pop(message.token, None)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif isinstance(message, Failed):
                    self._fail(message.message)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not self._closing:
                self._fail(f"the engine process went away (exit code {self.proc.poll()}; {type(exc).__name__})")

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("%s failed: %s", self.label or "engine process", reason)
        if self.label is None:
            self.streams.fail_all(APIError(500, f"the engine failed: {reason}", type="server_error", code="engine_error"))
        else:  # one replica of several: only its requests end, and the client may retry at once
            self.streams.fail_all(APIError(503, f"{self.label} died while serving this request ({reason}); the "
                                           "other replicas serve on: retry", type="server_error", code="replica_dead"),
                                  owner=self.owner)
        for future in self._pending.values():
            if not future.done():
                future.set_result(Rejected(-1, reason))
        self.on_death(reason)

    def _send(self, message: Any) -> None:
        self._write(frame(message))

    def _write(self, data: bytes) -> None:
        self._writer.write(data)  # buffered, in order, never blocks the loop

    async def submit(self, items: list[PromptChoices], fill_context: bool = False,
                     want_prompt_ids: bool = False) -> list[RequestStream]:
        if self.failure is not None:
            raise APIError(503, f"the engine stopped after an error: {self.failure}; restart the server",
                           type="server_error", code="engine_dead")
        await self._started.wait()
        dumped: dict[int, dict] = {}  # choices share SamplingParams objects (api.py): each is dumped once
        wire = [(Prompt.of(prompt), [(rid, dumped.get(id(p)) or dumped.setdefault(id(p), p.model_dump(mode="json")))
                                     for rid, p in choices]) for prompt, choices in items]
        token = next(self._tokens)
        data = frame(Add(token, wire, fill_context, want_prompt_ids))  # raises before anything is registered (checks.py should
        ready = asyncio.Event()  # have refused what the wire cannot carry; this keeps a slip from leaking)
        streams = [self.streams.register(rid, ready, self.owner) for _, choices in items for rid, _ in choices]
        future = self._pending[token] = asyncio.get_running_loop().create_future()
        try:
            self._write(data)
        except BaseException:  # the engine never heard of them: take them back whole
            self._pending.pop(token, None)
            for stream in streams:
                self.streams.forget(stream.request_id)
            raise
        try:
            answer = await future
        except asyncio.CancelledError:  # the client left before the engine accepted: take the requests back
            self._pending.pop(token, None)
            for stream in streams:
                self.abort(stream.request_id)
            raise
        if isinstance(answer, Rejected):
            for stream in streams:
                self.streams.forget(stream.request_id)
            if self.failure is not None:
                raise APIError(503, f"the engine stopped after an error: {self.failure}", type="server_error",
                               code="engine_dead")
            raise RequestError(answer.message)
        if answer.prompt_token_ids is not None:
            choices = iter(streams)
            for ids, (_, item_choices) in zip(answer.prompt_token_ids, items):
                for _ in item_choices:
                    next(choices).prompt_token_ids = ids
        return streams

    def abort(self, request_id: str) -> None:
        if request_id in self.streams.open and self._writer is not None:
            self._send(Abort(request_id))

    async def load_adapter(self, name: str, path: str) -> None:
        await self._adapter(LoadAdapter(next(self._tokens), name, path))

    async def unload_adapter(self, name: str) -> None:
        await self._adapter(LoadAdapter(next(self._tokens), name, None))

    async def _adapter(self, message: LoadAdapter) -> None:
        """Ask the engine process to change its adapters; raises its AdapterError as one."""
        if self.failure is not None:
            raise APIError(503, f"the engine stopped after an error: {self.failure}", type="server_error",
                           code="engine_dead")
        await self._started.wait()
        future = self._pending[message.token] = asyncio.get_running_loop().create_future()
        self._send(message)
        answer = await future
        if isinstance(answer, Rejected):
            raise AdapterError(answer.message)

    def stop(self) -> None:
        """Ask the engine process to exit, and make sure it does (idempotent)."""
        self._closing = True
        try:  # end of stream tells the child to stop (thread-safe, unlike writing beside the loop's transport)
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()


def _tokenizer(model: str) -> Any:
    from nanoplug.checkpoint.loader import checkpoint_dir, load_hf_config
    from nanoplug.checkpoint.source import resolve_model_path
    from nanoplug.engine.tokenizer import load_tokenizer

    folder = checkpoint_dir(resolve_model_path(model))
    return load_tokenizer(folder, load_hf_config(folder))  # (the engine process checked the config already)


# -------------------------------------------------------------------------------- the child
def main(fd: int) -> int:
    """The engine process: read requests from the socket, step, write updates back."""
    from nanoplug.engine.driver import Driver
    from nanoplug.engine.engine_core import EngineCore

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end decides
    cpus = os.environ.get("NANOPLUG_REPLICA_CPUS")  # a data-parallel replica on the CPU: its share of the cores
    if cpus:
        import torch

        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        torch.set_num_threads(len(cpus.split(",")))
    sock = socket.socket(fileno=fd)
    send_lock = threading.Lock()

    def send(message: Any) -> None:
        data = frame(message)
        with send_lock:
            sock.sendall(data)

    start = recv_message(sock)
    if not isinstance(start, Start):
        return 1
    try:
        core = EngineCore(EngineConfig(**start.config))
    except Exception as exc:
        send(Failed(f"{type(exc).__name__}: {exc}"))
        return 1
    class Wire:  # the driver's Sink: each step's updates as one frame
        def deliver(self, updates: list) -> None:
            send(Stepped([_update(u) for u in updates], _stats(driver.stats)))

        def fail(self, error: BaseException) -> None:
            pass  # the front end fails every stream on the Failed frame below

    def failed(exc: BaseException) -> None:
        log.error("engine step failed", exc_info=exc)
        send(Failed(f"{type(exc).__name__}: {exc}"))

    wire = Wire()
    driver = Driver(core, on_idle=lambda stats: send(Stepped([], _stats(stats))), on_failure=failed,
                    stop_on_failure=True)
    send(Ready(core.config.max_model_len, core.config.max_num_seqs, core.facts.vocab_size, _stats(core.stats()),
               core.max_loras))
    prepare = ThreadPoolExecutor(1, thread_name_prefix="nanoplug-prepare")

    def add(message: Add) -> None:
        try:
            items = [(prompt.value(), [(rid, SamplingParams(**params)) for rid, params in choices])
                     for prompt, choices in message.items]
            requests = prepare_all(core, items, message.fill_context)
        except (RequestError, ValueError) as exc:
            send(Rejected(message.token, str(exc)))
            return
        try:
            driver.submit(requests, wire)
        except Exception as exc:  # noqa: BLE001 (an id in use, a closed engine: the front end releases them)
            send(Rejected(message.token, str(exc)))
            return
        ids = None
        if message.want_prompt_ids:
            firsts, k = [], 0
            for _, choices in message.items:
                firsts.append(list(requests[k].prompt_token_ids))
                k += len(choices)
            ids = firsts
        send(Accepted(message.token, ids))

    def change_adapter(message: LoadAdapter) -> None:
        try:
            if message.path is None:
                driver.between_steps(core.unload_adapter, message.name)
            else:
                driver.between_steps(core.load_adapter, message.name, message.path)
        except NanoplugError as exc:  # a folder that does not fit: nothing changed
            send(Rejected(message.token, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 (the front end must hear an answer)
            log.exception("changing adapter %r failed", message.name)
            send(Rejected(message.token, f"{type(exc).__name__}: {exc}"))
            return
        send(Accepted(message.token))

    try:
        while True:
            message = recv_message(sock)
            if message is None:  # the front end closed its end: stop
                break
            if isinstance(message, Add):
                prepare.submit(add, message)
            elif isinstance(message, Abort):  # through the same queue, so it never overtakes its request's Add
                prepare.submit(driver.abort, message.request_id)
            elif isinstance(message, LoadAdapter):  # after the Adds before it, between two steps
                prepare.submit(change_adapter, message)
    finally:
        driver.stop()
        prepare.shutdown(wait=False, cancel_futures=True)
        core.close()
        sock.close()
    return 0


def _logprobs(e: Any) -> TokenLogprobs | None:
    return None if e is None else TokenLogprobs(e.token_id, e.logprob, e.rank, [(int(i), float(lp)) for i, lp in e.top])


def _update(u: Any) -> Update:
    logprobs = None if u.logprobs is None else [_logprobs(e) for e in u.logprobs]
    prompt = None if u.prompt_logprobs is None else [_logprobs(e) for e in u.prompt_logprobs]
    return Update(u.request_id, list(u.token_ids), u.text, u.finished, u.finish_reason, u.num_prompt_tokens,
                  u.num_cached_tokens, logprobs, prompt, u.queue_time)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="nanoplug engine: %(message)s")
    sys.exit(main(int(sys.argv[1])))
