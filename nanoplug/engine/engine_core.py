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
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from nanoplug.api import LogitsProcessingBatch, LogprobsTensors, SamplingBatch, SlotInit, StepBatch, StepResult
from nanoplug.engine.blocks import BlockManager
from nanoplug.engine.chat_template import chat_token_ids
from nanoplug.engine.chat_tools import for_template
from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.engine.context_length import checked_max_model_len
from nanoplug.errors import EngineClosedError, RequestError
from nanoplug.checkpoint.loader import checkpoint_dir
from nanoplug.engine.penalties import add_sample_row, check_token_ids
from nanoplug.worker.logprobs import token_logprobs
from nanoplug.checkpoint.source import resolve_model_path
from nanoplug.engine.outputs import OutputProcessor, RequestState, RequestUpdate
from nanoplug.engine.registry import Registry, default_registry
from nanoplug.engine.requests import token_ids
from nanoplug.worker.runner import PluginClasses, RunnerFactory, WorkerSpec
from nanoplug.engine.scheduler import Scheduled, Scheduler
from nanoplug.engine.sequence import PENDING, Sequence, Status
from nanoplug.engine.startup import Checkpoint, resolve_plugins, with_weight_format
from nanoplug.engine.structured import StructuredOutputs
from nanoplug.engine.tokenizer import load_tokenizer

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
    # True: an update every step that adds tokens (streams); False: one update when it finishes, with all
    # of its tokens and text (vLLM's FINAL_ONLY: generate() needs no per-token traffic)
    incremental_text: bool = True


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
    sampled: list[Sequence]  # the sequence of each sample row (n > 1: a fork puts several on one query row)
    prompt_scored: list[tuple[Sequence, int, int]]  # (sequence, first position, count) of the prompt logprobs
    row_of: dict[int, int]  # seq_id -> row of the step's sampled tokens
    masked: list[Sequence] | None = None  # structured outputs: the sequence of each of sampling.mask_rows


class EngineCore:
    """One checkpoint served by one worker (a device, or a proxy over tensor-parallel ranks)."""

    worker = None  # set once the worker starts; None again after close()

    def __init__(self, config: EngineConfig, registry: Registry | None = None):
        """config.model: a checkpoint folder, or a Hugging Face id (fetched where the network allows)."""
        started = time.perf_counter()
        config = config.model_copy(update={"model": resolve_model_path(config.model)})
        self.registry = registry or default_registry()
        checkpoint = Checkpoint.load(config.model, self.registry)  # config.json read once, here
        self.hf_config, self.facts = checkpoint.hf_config, checkpoint.facts
        config.max_model_len = checked_max_model_len(config.max_model_len, "max_model_len" in config.model_fields_set,
                                                     self.hf_config, str(checkpoint_dir(config.model) / "config.json"))
        self.config = config = with_weight_format(self.registry, config, checkpoint)
        # per-request adapters (merge=False), by the name requests give: ids 1..K in config order, 0 = none
        self.request_adapter_ids = {spec.label: i for i, spec in enumerate((s for s in config.adapters if not s.merge), 1)}
        self.choices, target = resolve_plugins(self.registry, config, checkpoint)
        self.device, self.dtype = target.device, target.dtype
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(checkpoint_dir(config.model))
        self.eos_token_ids = self._eos_ids()
        self.structured = StructuredOutputs(*StructuredOutputs.resolve(self.registry, config.structured_output, target),
                                            self.tokenizer, self.facts.vocab_size, self.eos_token_ids)
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
        self.defers_sampling = bool(getattr(self.worker, "defers_sampling", False))
        self.requests: dict[str, RequestState] = {}  # every request added and not finished, by id
        self.in_flight: _Launched | None = None  # overlapped: the launched step whose tokens are still to come
        self.last_step = (False, 0, 0)  # (is_prefill, tokens, sequences) of the last step resolved
        self._inbox: deque[tuple[str, Any]] = deque()  # ("add", EngineRequest) | ("abort", request_id)
        self._inbox_lock = threading.Lock()
        self._ids: set[str] = set()  # ids added and not finished (the inbox's included)
        self._tokenizer_lock = threading.Lock()  # make_request tokenizes while a step may detokenize
        self._next_id = itertools.count()
        self.prompt_tokens_total = self.generated_tokens_total = 0
        report = self.worker.report()
        if report is not None:  # the worker's phases; the rest (config, tokenizer, starting processes) is the engine's
            log.info("engine ready in %.3f s; worker %s", time.perf_counter() - started, report.startup)

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
        so = self.structured.resolution
        return self.choices.describe() + [so.describe() if so is not None else
                                          f"structured_output: asked 'auto', none ({self.structured.why_none})"]

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
        check_token_ids(params, vocab, f"prompt {index}")
        if params.structured_outputs is not None:
            self.structured.check(params, f"prompt {index}")  # compiled now: a bad constraint is never queued
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
            self.scheduler.abort(state.seq)  # every sample of it
            updates += [self._sample_finished(s) for s in state.samples if not s.final_sent]
        return updates

    def _add(self, request: EngineRequest) -> None:
        p = request.params
        seq = Sequence(list(request.prompt_token_ids), p, request_id=request.request_id,
                       adapter_id=self.request_adapter_ids.get(p.adapter, 0))
        self.requests[request.request_id] = self.outputs.start(request.request_id, seq, request.incremental_text)
        self.prompt_tokens_total += len(seq)
        self.scheduler.add(seq)

    def _sample_finished(self, state: RequestState) -> RequestUpdate:
        """The last update of a sample (of the request, when it was the last of its samples to end)."""
        update = self.outputs.update(state)
        if update.finished:
            self.requests.pop(state.request_id, None)  # (an abort finishes several samples at once)
            with self._inbox_lock:
                self._ids.discard(state.request_id)
        return update

    def _start_forked(self) -> None:
        """Output state for the samples the scheduler just forked (n > 1), in sample order."""
        for seq in self.scheduler.take_forked():
            first = self.requests[seq.request_id]
            first.samples.append(self.outputs.start(seq.request_id, seq, first.incremental))

    # ---------------------------------------------------------------------------- stepping
    def _build_step(self, batch: list[Scheduled], is_prefill: bool) -> _Launched:
        """The step's data, with the sequence of each sample row and the prompt positions it scores."""
        input_ids, starts, q_lens, tables, rows, logits_rows = [], [], [], [], [], []
        temps, top_ks, top_ps, min_ps, seeds, positions, adapter_ids = [], [], [], [], [], [], []
        prev_at, prev_rows, sampled, prompt_scored = [], [], [], []
        processing, logprob_rows, num_top = None, [], []
        mask_rows, masked = [], []
        plp_at, plp_ids, plp_top = [], [], 0
        row_of = self.in_flight.row_of if self.in_flight is not None else {}
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                first = max(start, len(seq.prompt_logprobs) - 1)  # position j scores prompt token j + 1
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    plp_at.extend(range(len(input_ids) + first - start, len(input_ids) + last - start))
                    plp_ids.extend(seq.token_ids[first + 1:last + 1])
                    plp_top = max(plp_top, seq.params.prompt_logprobs)
                    prompt_scored.append((seq, first, last - first))
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
                for s in (seq, *item.forks) if item.forks else (seq,):  # n > 1: every sample draws from row i
                    p = s.params
                    if p.output_logits:
                        logits_rows.append(len(rows))
                    if p.needs_sampler_extras:
                        processing = self._sampler_extras(s, len(rows), processing, logprob_rows, num_top)
                    if p.structured_outputs is not None:
                        mask_rows.append(len(rows))
                        masked.append(s)
                    rows.append(i)
                    sampled.append(s)
                    temps.append(p.temperature)
                    top_ks.append(p.top_k)
                    top_ps.append(p.top_p)
                    min_ps.append(p.min_p)
                    seeds.append(p.seed)
                    positions.append(len(s))
        sampling = SamplingBatch(temps, top_ks, top_ps, min_ps, seeds, positions, processing, logprob_rows, num_top)
        if masked:  # overlapped: the masks follow the launch (`_sample_masked`), once the grammars know every token
            sampling.mask_rows, sampling.mask_later = mask_rows, self.overlap and self.defers_sampling
            if not sampling.mask_later:
                sampling.bitmask = self.structured.masks(masked)
        blocks = self.scheduler.blocks
        step = StepBatch(is_prefill, input_ids, starts, q_lens, tables, rows, sampling, logits_rows, adapter_ids,
                         new_blocks=blocks.take_new_blocks(), from_previous_at=prev_at, from_previous_rows=prev_rows,
                         block_copies=blocks.take_copies(), prompt_logprob_at=plp_at, prompt_logprob_ids=plp_ids,
                         prompt_logprob_top=plp_top)
        return _Launched(batch, step, sampled, prompt_scored, {}, masked or None)

    def _sampler_extras(self, seq: Sequence, row: int, processing: LogitsProcessingBatch | None,
                        logprob_rows: list[int], num_top: list[int]) -> LogitsProcessingBatch | None:
        """Sample row `row` (of `seq`) has penalties, a bias or logprobs: add them to the step's sampling data.

        A penalized sequence gets its token-count slot, filled from its tokens, the first time it samples."""
        p = seq.params
        if p.processes_logits:
            if processing is None:
                processing = LogitsProcessingBatch()
            if p.penalized and seq.penalty_slot is None:
                seq.penalty_slot = self.scheduler.penalty_slots.take()
                processing.inits.append(SlotInit(seq.penalty_slot, seq.token_ids[:seq.num_prompt_tokens],
                                                 seq.completion_token_ids))
            add_sample_row(processing, row, p, seq.penalty_slot)
        if p.logprobs is not None:
            logprob_rows.append(row)
            num_top.append(p.logprobs)
        return processing

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
            self._start_forked()
            launched = self._build_step(batch, is_prefill)
            result = self.worker.run(launched.step)
            self.scheduler.advance(batch)
            return updates + self._apply(launched, result)
        launched = None
        if self.in_flight is not None and self.in_flight.masked and not self.defers_sampling:
            # a worker that cannot sample after its launch: a grammar's mask needs the step before it collected
            previous, self.in_flight = self.in_flight, None
            updates += self._apply(previous, self.worker.collect())
        if self.scheduler.has_work():
            batch, is_prefill = self.scheduler.schedule()
            if batch:
                self._start_forked()
                launched = self._build_step(batch, is_prefill)
                self.worker.launch(launched.step)
                self.scheduler.advance(batch, pending=True)
                launched.row_of = {seq.seq_id: k for k, seq in enumerate(launched.sampled)}
        previous, self.in_flight = self.in_flight, launched
        if previous is None:
            if launched is None and self.scheduler.has_work():
                raise RuntimeError(NOTHING_TO_RUN)
            self._sample_masked(launched)
            return updates
        updates += self._apply(previous, self.worker.collect())
        self._sample_masked(launched)
        return updates

    def _sample_masked(self, launched: _Launched | None) -> None:
        """Structured outputs, overlapped: the launched step's forward runs while the previous step's tokens
        advanced the grammars; now its masks are filled on the host and it is sampled under them."""
        if launched is not None and launched.step.sampling.mask_later:
            self.worker.sample(self.structured.masks(launched.masked))

    def _apply(self, launched: _Launched, result: StepResult) -> list[RequestUpdate]:
        """Give a finished step's tokens to their sequences, register full blocks, check for stops."""
        batch, step = launched.batch, launched.step
        self.last_step = (step.is_prefill, sum(step.query_lens), len(batch))
        logits_of = dict(zip(step.logits_rows, result.logits)) if step.logits_rows else None
        logprobs_of = None
        if result.logprobs is not None:
            rows = step.sampling.logprob_rows
            logprobs_of = dict(zip(rows, token_logprobs(result.logprobs, [result.tokens[k] for k in rows],
                                                        step.sampling.num_top_logprobs)))
        if result.prompt_logprobs is not None:
            _add_prompt_logprobs(launched.prompt_scored, step, result.prompt_logprobs)
        got = []
        for k, (seq, token) in enumerate(zip(launched.sampled, result.tokens)):
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
                if seq.sample_index:
                    state = state.samples[seq.sample_index]
                if logits_of is not None and k in logits_of:
                    state.logits.append(logits_of[k])
                if logprobs_of is not None and k in logprobs_of:
                    state.logprobs.append(logprobs_of[k])
                reason = outputs.finish_reason(state, token)
                if seq.params.structured_outputs is not None:
                    done = self.structured.accept(seq, token)
                    if reason is None and done is not None:  # the grammar ended (even with ignore_eos), or broke
                        reason = done
                        if state.detok is not None:
                            state.detok.flush()
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    updates.append(self._sample_finished(state))
                elif state.incremental:  # a final-only request hears once, when it finishes
                    updates.append(outputs.update(state))
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

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The conversation through the checkpoint's chat template, as token ids. Text inside the messages
        never becomes a special token (see core/chat_template.py); the template's own tokens do. `tools` (and
        tool calls and results in the messages) go through engine/chat_tools.py first."""
        self._check_open()
        if self.tokenizer is None:
            raise RequestError("chat needs the checkpoint's tokenizer and chat template, but this LLM was created "
                               "with skip_tokenizer_init=True; give generate() token ids instead")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"the tokenizer of {self.config.model!r} has no chat template; use generate() with plain text")
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages if isinstance(m, dict)):
            messages, tools = for_template(messages, tools, self.tokenizer.chat_template, self.tool_call_format)
        with self._tokenizer_lock:
            return chat_token_ids(self.tokenizer, messages, tools)

    @property
    def tool_call_format(self) -> Any:
        """How this model writes tool calls (its model plugin's ToolCallFormat), or None."""
        return getattr(self.choices["model"].cls, "tool_call_format", None)

    def close(self) -> None:
        """Stop the worker; safe to call twice."""
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.shutdown()


def _add_prompt_logprobs(scored: list[tuple[Sequence, int, int]], step: StepBatch, tensors: LogprobsTensors) -> None:
    """Hand each sequence the logprobs of the prompt positions the step scored for it, in order; a position
    it already has (scored again after a preemption) is not added twice."""
    everything = token_logprobs(tensors, step.prompt_logprob_ids, [step.prompt_logprob_top] * len(step.prompt_logprob_ids))
    at = 0
    for seq, first, count in scored:
        k = seq.params.prompt_logprobs
        for j, lp in enumerate(everything[at:at + count], first):
            if len(seq.prompt_logprobs) == j + 1:
                lp.top = lp.top[:k]
                seq.prompt_logprobs.append(lp)
        at += count
