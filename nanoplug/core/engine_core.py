"""The engine core (vLLM's engine-core shape): requests in through `add_request`/`abort`, one step at a
time through `step`, what each step added to each request out as `RequestUpdate`s.

It is the one owner of requests and of everything in flight: the scheduler's sequences, each
request's output state, and, with overlapped steps, the step launched but not yet collected. Start-up
(core/startup.py) resolves the plugins once and starts the parallel strategy's worker; each step is
schedule -> build the step's data -> launch on the worker -> collect -> apply the tokens (scheduler)
and turn them into updates (core/outputs.py).

`add_request` and `abort` may be called from any thread: they go through an inbox that `step`
drains. `step` itself runs on one thread at a time (LLM's step lock, or the server's loop).
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from nanoplug.api import SamplingBatch, StepBatch, StepResult
from nanoplug.core.blocks import BlockManager
from nanoplug.core.chat_template import chat_token_ids
from nanoplug.core.config import EngineConfig, SamplingParams
from nanoplug.core.context_length import checked_max_model_len
from nanoplug.core.errors import EngineClosedError, RequestError
from nanoplug.core.loader import checkpoint_dir
from nanoplug.core.model_source import resolve_model_path
from nanoplug.core.outputs import OutputProcessor, RequestState, RequestUpdate
from nanoplug.core.registry import Registry, default_registry
from nanoplug.core.request_input import token_ids
from nanoplug.core.runner import PluginClasses, RunnerFactory, WorkerSpec
from nanoplug.core.scheduler import Scheduled, Scheduler
from nanoplug.core.sequence import PENDING, Sequence, Status
from nanoplug.core.startup import Checkpoint, resolve_plugins
from nanoplug.core.tokenizer import load_tokenizer

__all__ = ["EngineCore", "EngineRequest", "EngineStats", "RequestUpdate"]
log = logging.getLogger("nanoplug")
NOTHING_TO_RUN = "the scheduler found nothing to run although requests wait; the KV cache is too small"


@dataclass
class EngineRequest:
    """One request, validated and tokenized by `EngineCore.make_request`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the caller gave text
    incremental_text: bool = True  # text in every update (streams); False: all of it in the last one


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prompt_tokens_total: int
    generated_tokens_total: int


@dataclass
class _Launched:
    """A step handed to the device: its schedule, its inputs, and each sampled sequence's row."""

    batch: list[Scheduled]
    step: StepBatch
    row_of: dict[int, int]  # seq_id -> row of the step's sampled tokens


class EngineCore:
    """One checkpoint served by one worker (a device, or a proxy over tensor-parallel ranks)."""

    worker = None  # set once the worker starts; None again after close()

    def __init__(self, config: EngineConfig, registry: Registry | None = None):
        """config.model: a checkpoint folder, or a Hugging Face id (fetched where the network allows)."""
        config = config.model_copy(update={"model": resolve_model_path(config.model)})
        self.registry = registry or default_registry()
        checkpoint = Checkpoint.load(config.model, self.registry)  # config.json read once, here
        self.hf_config, self.facts = checkpoint.hf_config, checkpoint.facts
        config.max_model_len = checked_max_model_len(config.max_model_len, "max_model_len" in config.model_fields_set,
                                                     self.hf_config, str(checkpoint_dir(config.model) / "config.json"))
        self.config = config
        # per-request adapters (merge=False), by the name requests give: ids 1..K in config order, 0 = none
        self.request_adapter_ids = {spec.label: i for i, spec in enumerate((s for s in config.adapters if not s.merge), 1)}
        self.choices, target = resolve_plugins(self.registry, config, checkpoint)
        self.device, self.dtype = target.device, target.dtype
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(checkpoint_dir(config.model))
        self.eos_token_ids = self._eos_ids()
        plugins = PluginClasses(
            model=self.choices["model"].cls,
            prefill_attention=self.choices["prefill_attention"].cls,
            decode_attention=self.choices["attention"].cls,
            kv_cache=self.choices["kv_cache"].cls,
            adapters=[(r.cls, spec) for r, spec in zip(self.choices["adapters"], config.adapters)],
            platform=self.choices["platform"].cls,
            platform_name=self.choices["platform"].name,
        )
        strategy = self.choices["parallel"].cls(target)
        self.worker = strategy.start(RunnerFactory(WorkerSpec(config, plugins, checkpoint.hf_config, checkpoint.facts,
                                                              target)))
        num_blocks = self.worker.num_kv_blocks()
        if num_blocks * config.kv_block_size < config.max_model_len:
            self.close()
            raise RuntimeError(
                f"the KV cache holds {num_blocks * config.kv_block_size} tokens, fewer than max_model_len "
                f"({config.max_model_len}); lower max_model_len or give the cache more memory"
            )
        self.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(config, BlockManager(num_blocks, config.kv_block_size, config.enable_prefix_caching))
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self.overlap = self._wants_overlap()
        self.requests: dict[str, RequestState] = {}  # every request added and not finished, by id
        self.in_flight: _Launched | None = None  # overlapped: the launched step whose tokens are still to come
        self.last_step = (False, 0, 0)  # (is_prefill, tokens, sequences) of the last step resolved
        self._inbox: deque[tuple[str, Any]] = deque()  # ("add", EngineRequest) | ("abort", request_id)
        self._inbox_lock = threading.Lock()
        self._ids: set[str] = set()  # ids added and not finished (the inbox's included)
        self._tokenizer_lock = threading.Lock()  # make_request tokenizes while a step may detokenize
        self._next_id = itertools.count()
        self.prompt_tokens_total = self.generated_tokens_total = 0

    # --------------------------------------------------------------------------- start-up
    def _wants_overlap(self) -> bool:
        """Overlapped steps: asked for, or the platform's default (on for CUDA: on a CPU the host computes the step itself)."""
        asked = self.config.overlap_steps
        if not self.choices["parallel"].cls.supports_overlap:
            if asked:
                log.warning("parallel strategy %r cannot overlap steps; they run one after another",
                            self.choices["parallel"].name)
            return False
        return self.choices["platform"].cls.overlaps_by_default() if asked is None else asked

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
        except Exception:
            eos = getattr(self.hf_config, "eos_token_id", None)
        for value in (eos, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return ids

    def describe_plugins(self) -> list[str]:
        """One line per kind: what was asked, what was chosen, and why."""
        return self.choices.describe()

    # ---------------------------------------------------------------------------- requests
    def _check_open(self) -> None:
        if self.worker is None:
            raise EngineClosedError("this LLM was closed; create a new one: LLM(model, ...)")

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, *, index: int = 0,
                     incremental_text: bool = True) -> EngineRequest:
        """Tokenize and check one prompt and its SamplingParams; raises RequestError saying what is wrong.

        `index`: the prompt's place in the caller's list, for messages."""
        self._check_open()
        params = params if params is not None else SamplingParams()
        ids = token_ids(index, prompt)
        if ids is None:
            if self.tokenizer is None:
                raise RequestError(f"prompt {index} is text, but this LLM has no tokenizer (skip_tokenizer_init=True); "
                                   "give token ids, or create the LLM without skip_tokenizer_init")
            with self._tokenizer_lock:
                ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        if not ids:
            raise RequestError(f"prompt {index} is empty; give it at least one token")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise RequestError(
                f"prompt {index} has {len(ids)} tokens, but max_model_len is {limit} (room for the prompt and "
                f"at least one new token); shorten the prompt or raise max_model_len"
            )
        vocab = self.facts.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt {index} has token id {bad[0]} outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"prompt {index} has stop strings, but this LLM has no tokenizer "
                               "(skip_tokenizer_init=True) to read text; use stop_token_ids")
        if params.adapter is not None and params.adapter not in self.request_adapter_ids:
            loaded = ", ".join(map(repr, self.request_adapter_ids)) or "none"
            raise RequestError(
                f"prompt {index} asks for adapter {params.adapter!r}, but this engine serves per request: {loaded}; "
                "pick one of those, or load it with LLM(..., adapters=[{'path': DIR, 'name': NAME, 'merge': False}])"
            )
        if request_id is None:
            request_id = f"req-{next(self._next_id)}"
        return EngineRequest(request_id, ids, params, prompt if isinstance(prompt, str) else None, incremental_text)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request for the next step (any thread)."""
        self._check_open()
        with self._inbox_lock:
            if request.request_id in self._ids:
                raise RequestError(f"request id {request.request_id!r} is already in use; give each request its own")
            self._ids.add(request.request_id)
            self._inbox.append(("add", request))

    def abort(self, request_id: str) -> None:
        """Drop a request (any thread); its blocks are freed and its last update ("abort") comes at the next step."""
        with self._inbox_lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        """Requests queued, waiting or running, or a step still on the device."""
        return bool(self._inbox) or self.scheduler.has_work() or self.in_flight is not None

    def _drain_inbox(self) -> list[RequestUpdate]:
        with self._inbox_lock:
            if not self._inbox:
                return []
            messages, self._inbox = self._inbox, deque()
        updates = []
        for kind, value in messages:
            if kind == "add":
                self._add(value)
                continue
            state = self.requests.get(value)
            if state is None:
                continue  # finished already, or never added: nothing to drop
            self.scheduler.abort(state.seq)
            updates.append(self._finished(state))
        return updates

    def _add(self, request: EngineRequest) -> None:
        p = request.params
        seq = Sequence(list(request.prompt_token_ids), p, request_id=request.request_id,
                       adapter_id=self.request_adapter_ids.get(p.adapter, 0))
        self.requests[request.request_id] = self.outputs.start(request.request_id, seq, request.incremental_text)
        self.prompt_tokens_total += len(seq)
        self.scheduler.add(seq)

    def _finished(self, state: RequestState) -> RequestUpdate:
        del self.requests[state.request_id]
        with self._inbox_lock:
            self._ids.discard(state.request_id)
        return self.outputs.update(state)

    # ---------------------------------------------------------------------------- stepping
    def _build_step(self, batch: list[Scheduled], is_prefill: bool) -> StepBatch:
        input_ids, starts, q_lens, tables, rows, logits_rows = [], [], [], [], [], []
        temps, top_ks, top_ps, min_ps, seeds, positions, adapter_ids = [], [], [], [], [], [], []
        prev_at, prev_rows = [], []
        row_of = self.in_flight.row_of if self.in_flight is not None else {}
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            if n == 1:  # decode: no slice
                token = seq.token_ids[start]
                if token == PENDING:  # sampled by the step still on the device: read it there
                    prev_at.append(len(input_ids))
                    prev_rows.append(row_of[seq.seq_id])
                input_ids.append(token)
            else:
                input_ids.extend(seq.token_ids[start:start + n])
            starts.append(start)
            q_lens.append(n)
            tables.append(seq.block_table)
            adapter_ids.append(seq.adapter_id)
            if item.samples:
                p = seq.params
                if p.output_logits:
                    logits_rows.append(len(rows))
                rows.append(i)
                temps.append(p.temperature)
                top_ks.append(p.top_k)
                top_ps.append(p.top_p)
                min_ps.append(p.min_p)
                seeds.append(p.seed)
                positions.append(len(seq))
        sampling = SamplingBatch(temps, top_ks, top_ps, min_ps, seeds, positions)
        return StepBatch(is_prefill, input_ids, starts, q_lens, tables, rows, sampling, logits_rows, adapter_ids,
                         new_blocks=self.scheduler.blocks.take_new_blocks(),
                         from_previous_at=prev_at, from_previous_rows=prev_rows)

    def step(self) -> list[RequestUpdate]:
        """Run one step: an update for every request that gained tokens or finished (aborted ones too).

        Overlapped (`overlap_steps`), a call launches the next step and then waits for the tokens of
        the one launched before it, so the device never waits for the host's bookkeeping. A
        sequence's newest token is then a placeholder that the device fills in; when that token
        ends the sequence (EOS, a stop string), the one step it ran ahead is thrown away."""
        self._check_open()
        updates = self._drain_inbox()
        if not self.overlap:
            if not self.scheduler.has_work():
                return updates
            batch, is_prefill = self.scheduler.schedule()
            if not batch:
                raise RuntimeError(NOTHING_TO_RUN)
            step = self._build_step(batch, is_prefill)
            result = self.worker.run(step)
            self.scheduler.advance(batch)
            return updates + self._apply(_Launched(batch, step, {}), result)
        launched = None
        if self.scheduler.has_work():
            batch, is_prefill = self.scheduler.schedule()
            if batch:
                step = self._build_step(batch, is_prefill)
                self.worker.launch(step)
                self.scheduler.advance(batch, pending=True)
                launched = _Launched(batch, step, {batch[row].seq.seq_id: k for k, row in enumerate(step.sample_rows)})
        previous, self.in_flight = self.in_flight, launched
        if previous is None:
            if launched is None and self.scheduler.has_work():
                raise RuntimeError(NOTHING_TO_RUN)
            return updates
        return updates + self._apply(previous, self.worker.collect())

    def _apply(self, launched: _Launched, result: StepResult) -> list[RequestUpdate]:
        """Give a finished step's tokens to their sequences, register full blocks, check for stops."""
        batch, step = launched.batch, launched.step
        self.last_step = (step.is_prefill, sum(step.query_lens), len(batch))
        logits_of = dict(zip(step.logits_rows, result.logits)) if step.logits_rows else None
        got = []
        for k, (row, token) in enumerate(zip(step.sample_rows, result.tokens)):
            seq = batch[row].seq
            if seq.status is Status.FINISHED:
                continue  # it ended at the step before (or was aborted): this one ran ahead for nothing
            self.scheduler.append_token(seq, token)
            got.append((seq, token, k))
        self.scheduler.commit(batch)  # full blocks are registered once their tokens are known
        self.generated_tokens_total += len(got)
        updates = []
        requests, outputs = self.requests, self.outputs
        with self._tokenizer_lock:
            for seq, token, k in got:
                state = requests[seq.request_id]
                if logits_of is not None and k in logits_of:
                    state.logits.append(logits_of[k])
                reason = outputs.finish_reason(state, token)
                if reason is None:
                    updates.append(outputs.update(state))
                else:
                    self.scheduler.finish(seq, reason)
                    updates.append(self._finished(state))
        return updates

    # ------------------------------------------------------------------------------ the rest
    def stats(self) -> EngineStats:
        blocks = self.scheduler.blocks
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            kv_blocks_used=self.num_kv_blocks - blocks.num_free_blocks, kv_blocks_total=self.num_kv_blocks,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
        )

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the checkpoint's chat template, as token ids. Text inside the messages
        never becomes a special token (see core/chat_template.py); the template's own tokens do."""
        self._check_open()
        if self.tokenizer is None:
            raise RequestError("chat needs the checkpoint's tokenizer and chat template, but this LLM was created "
                               "with skip_tokenizer_init=True; give generate() token ids instead")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"the tokenizer of {self.config.model!r} has no chat template; use generate() with plain text")
        with self._tokenizer_lock:
            return chat_token_ids(self.tokenizer, messages)

    def close(self) -> None:
        """Stop the worker; safe to call twice."""
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.shutdown()
