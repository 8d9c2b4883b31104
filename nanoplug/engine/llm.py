"""`LLM`: the public API (generate, stream, chat) on top of one EngineCore.

Several threads may call `generate` and `stream` at once, and their requests join the same steps:
the engine's `Driver` (engine/driver.py, the server's stepper too) runs `EngineCore.step()` in its own
thread and hands each update to the mailbox of the caller that owns its request, so no caller waits
for another's requests to finish. A lone caller runs the driver's steps on its own thread instead
(`Driver.step_here`), saving a thread hand-off per step; a second caller wakes the driver's thread.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence as Seq

from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.engine.driver import Driver
from nanoplug.engine.engine_core import EngineCore, EngineRequest
from nanoplug.checkpoint.loader import checkpoint_dir
from nanoplug.checkpoint.source import resolve_model_path
from nanoplug.engine.outputs import CompletionOutput, RequestOutput, RequestUpdate, StreamDelta
from nanoplug.engine.registry import Registry, default_registry
from nanoplug.errors import EngineClosedError
from nanoplug.engine.requests import params_list, prompt_list

__all__ = ["LLM", "RequestOutput", "StreamDelta"]


class LLM:
    """An inference engine for one checkpoint: `LLM(path, attention="sdpa", kv_cache="torch", ...)`."""

    engine: EngineCore | None = None
    driver: Driver | None = None

    def __init__(self, model: str | os.PathLike, registry: Registry | None = None, **options: Any):
        registry = registry or default_registry()
        platforms = registry.names("platform")  # each takes its options under its name: cuda={...}
        unknown = sorted(set(options) - set(EngineConfig.model_fields) - set(platforms))
        if unknown:
            raise TypeError(
                f"unknown option(s) {', '.join(map(repr, unknown))} for LLM; valid options: "
                + ", ".join(sorted(f for f in EngineConfig.model_fields if f != "model"))
                + f"; a platform's options under its name ({', '.join(f'{p}={{...}}' for p in platforms)})"
            )
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model is a {type(model).__name__}; give a checkpoint folder (a str or pathlib.Path) "
                            "or a Hugging Face model id")
        path = resolve_model_path(model)
        if isinstance(model, os.PathLike):
            checkpoint_dir(path)  # a Path names a folder: say so if it is not one (never a hub lookup)
        self.engine = EngineCore(EngineConfig(model=path, **options), registry)
        self.driver = Driver(self.engine)  # the one stepper of the engine, for every calling thread
        self._callers_lock = threading.Lock()
        self._callers = 0

    # ------------------------------------------------------------------- the engine's facts
    config = property(lambda self: self.engine.config)
    tokenizer = property(lambda self: self.engine.tokenizer)
    eos_token_ids = property(lambda self: self.engine.eos_token_ids)
    choices = property(lambda self: self.engine.choices)
    device = property(lambda self: self.engine.device)
    dtype = property(lambda self: self.engine.dtype)
    registry = property(lambda self: self.engine.registry)

    def describe_plugins(self) -> list[str]:
        """One line per kind: what was asked, what was chosen, and why."""
        return self.engine.describe_plugins()

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA folder `path` per request as `name` from now on (a free one of `max_loras` slots),
        between two steps; raises AdapterError naming what does not fit, and then nothing changed."""
        self.driver.between_steps(self.engine.load_adapter, name, path)

    def unload_adapter(self, name: str) -> None:
        """Refuse new requests for adapter `name`; those running finish with it."""
        self.driver.between_steps(self.engine.unload_adapter, name)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the checkpoint's chat template, as token ids."""
        return self.engine.chat_prompt_ids(messages)

    # ------------------------------------------------------------------------------ public
    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt, batched continuously; one output per prompt, in order.

        A prompt is a string or token ids (ints, numpy/torch integers, a 1-d integer array); sampling_params
        is one SamplingParams (or dict of its fields) for all, one per prompt, or None for the defaults.
        Anything else is a RequestError that says what to pass (nanoplug/engine/requests.py)."""
        self.engine._check_open()
        prompts = prompt_list(prompts)
        params = params_list(sampling_params, len(prompts))
        # every prompt is checked before any is queued: bad input never costs others their work
        requests = [self.engine.make_request(p, sp, index=i, incremental_text=False)
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        outputs = {r.request_id: _Collected(i, r) for i, r in enumerate(requests)}
        bar = _Progress(len(requests)) if use_tqdm else None
        start = time.perf_counter()
        try:
            for updates in self._run(requests):
                finished = 0
                for update in updates:
                    outputs[update.request_id].add(update)
                    finished += update.finished
                if bar:
                    now = time.perf_counter()
                    bar.update(self.engine.last_step, now - start, finished)
                    start = now
        finally:
            if bar:
                bar.close()
        return [c.output() for c in outputs.values()]

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield the text and token ids each step adds to one request, the last delta marked finished.

        With n > 1 each delta says which sample it extends (`index`), and each sample's last is marked finished."""
        (params,) = params_list(sampling_params, 1)
        request = self.engine.make_request(prompt, params)
        for updates in self._run([request]):
            for u in updates:
                done = u.finish_reason is not None  # this sample's last update
                if u.token_ids or done:
                    yield StreamDelta(u.text, u.token_ids, done, u.finish_reason, u.index, u.logprobs)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list of them) and generate."""
        self.engine._check_open()
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = [self.chat_prompt_ids(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------- stepping together
    def _run(self, requests: list[EngineRequest]) -> Iterator[list[RequestUpdate]]:
        """Add `requests` and yield their updates as the driver's steps produce them, until each has
        finished; a step's error is raised here. If the caller stops early (an error, Ctrl-C, a stream
        closed), its unfinished requests are aborted."""
        box = _Mailbox()
        pending = {r.request_id for r in requests}
        with self._callers_lock:
            self._callers += 1
            alone = self._callers == 1
        driver = self.driver
        last: list[RequestUpdate] | None = None
        try:
            driver.submit(requests, box, wake=not alone)
            while pending:
                updates = box.take(block=False)
                if not updates:
                    if self._callers == 1 and driver.step_here():
                        continue  # a step on this thread: no hand-off while no one else is waiting
                    updates = box.take()
                pending.difference_update(u.request_id for u in updates if u.finished)
                if not pending:  # the caller is out before it hears the end: a stream whose reader stops
                    last = updates  # at its last delta must not keep others' aborted requests from settling
                    break
                yield updates
        except BaseException:  # GeneratorExit included: the caller stopped reading
            for request_id in pending:
                self.driver.abort(request_id)
            self._leave(quiet=True)
            raise
        self._leave(quiet=False)
        if last is not None:
            yield last

    def _leave(self, quiet: bool) -> None:
        """The last caller out waits until the driver is idle: the step that ran ahead of a finished request
        is collected, and aborted requests have given their blocks back, when generate returns. `quiet`:
        another error is on its way up; one from settling must not hide it."""
        with self._callers_lock:
            self._callers -= 1
            last_out = self._callers == 0
        if not last_out:
            return
        driver = self.driver
        before = driver.failure
        while self._callers == 0 and driver.step_here():
            pass  # settle on this thread while no new caller came (it steps its own then)
        driver.wait_idle()
        failure = self.driver.failure
        if not quiet and failure is not None and failure is not before:
            raise failure

    # ------------------------------------------------------------------------------ closing
    def close(self) -> None:
        driver, engine = self.driver, self.engine
        if driver is not None:
            driver.stop(EngineClosedError("this LLM was closed while the request ran; create a new one: LLM(model, ...)"))
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Mailbox:
    """One caller's updates, handed over by the driver's thread (a `Sink`)."""

    __slots__ = ("_cond", "_updates", "_error")

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._updates: list[RequestUpdate] = []
        self._error: BaseException | None = None

    def deliver(self, updates: list[RequestUpdate]) -> None:
        with self._cond:
            self._updates += updates
            self._cond.notify()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify()

    def take(self, block: bool = True) -> list[RequestUpdate]:
        """What arrived since the last take, waiting for something (or [] at once if not `block`); the
        step's error once drained."""
        with self._cond:
            while not self._updates and self._error is None:
                if not block:
                    return []
                self._cond.wait()
            if self._updates:
                updates, self._updates = self._updates, []
                return updates
            raise self._error


@dataclass
class _Collected:
    """One generate request's updates, gathered into its RequestOutput (one _Sample per sample)."""

    index: int
    request: EngineRequest
    samples: dict[int, "_Sample"] = field(default_factory=dict)
    prompt_logprobs: list[Any] | None = None

    def add(self, update: RequestUpdate) -> None:
        sample = self.samples.get(update.index)
        if sample is None:
            sample = self.samples[update.index] = _Sample()
        sample.add(update)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs

    def output(self) -> RequestOutput:
        r = self.request
        samples = [self.samples[i] for i in sorted(self.samples)]
        outputs = [CompletionOutput(i, "".join(s.text), s.token_ids, s.last.finish_reason,
                                    s.logprobs if r.params.logprobs is not None else None, s.logits)
                   for i, s in zip(sorted(self.samples), samples)]
        return RequestOutput(index=self.index, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
                             outputs=outputs, num_cached_tokens=samples[0].last.num_cached_tokens,
                             prompt_logprobs=self.prompt_logprobs)


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    last: RequestUpdate | None = None

    def add(self, update: RequestUpdate) -> None:
        self.token_ids += update.token_ids
        if update.text:
            self.text.append(update.text)
        if update.logits:
            self.logits += update.logits
        if update.logprobs:
            self.logprobs += update.logprobs
        self.last = update


class _Progress:
    """A tqdm bar with prefill and decode throughput."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Generating", dynamic_ncols=True)
        self.tokens = {True: 0, False: 0}  # is_prefill -> tokens computed
        self.seconds = {True: 0.0, False: 0.0}

    def rate(self, prefill: bool) -> float:
        return self.tokens[prefill] / max(self.seconds[prefill], 1e-9)

    def update(self, last_step: tuple[bool, int, int], seconds: float, finished: int) -> None:
        is_prefill, tokens, _ = last_step
        self.tokens[is_prefill] += tokens
        self.seconds[is_prefill] += seconds
        self.bar.set_postfix_str(f"prefill {self.rate(True):,.0f} tok/s, decode {self.rate(False):,.0f} tok/s",
                                 refresh=False)
        self.bar.update(finished)

    def close(self) -> None:
        self.bar.close()
