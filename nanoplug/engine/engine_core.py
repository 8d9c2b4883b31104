"""The engine core (vLLM's engine-core shape): requests in through `add_request`/`abort`, one step at a
time through `step`, what each step added to each request out as `RequestUpdate`s.

It is the one owner of requests and of everything in flight: the scheduler's sequences, each
request's output state, and, with overlapped steps, the step launched but not yet collected. Start-up
(engine/startup.py) resolves the plugins once and starts the parallel strategy's worker; requests are
checked in engine/requests.py; each step is schedule -> build the step's data (engine/batch.py) ->
launch on the worker -> collect -> apply the tokens (scheduler) and turn them into updates
(engine/outputs.py).

`add_request` and `abort` may be called from any thread: they go through an inbox that `step`
drains. `step` itself runs on one thread at a time (LLM's step lock, or the server's loop).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from nanoplug.api import StepResult, pick_tool_call_format
from nanoplug.engine.batch import BatchBuilder, Launched
from nanoplug.engine.hybrid_blocks import block_manager_for
from nanoplug.engine.chat_template import chat_token_ids
from nanoplug.engine.chat_tools import for_template
from nanoplug.config import AdapterSpec, EngineConfig, SamplingParams
from nanoplug.errors import AdapterError, ConfigError, EngineClosedError, RequestError
from nanoplug.engine.outputs import OutputProcessor, RequestState, RequestUpdate
from nanoplug.engine.registry import Registry, default_registry
from nanoplug.engine.requests import EngineRequest, RequestMaker
from nanoplug.engine.scheduler import Scheduler
from nanoplug.engine.sequence import Sequence, Status
from nanoplug.engine.speculation import Speculation
from nanoplug.engine.startup import start
from nanoplug.engine.structured import StructuredOutputs

__all__ = ["EngineCore", "EngineRequest", "EngineStats", "RequestUpdate"]
log = logging.getLogger("nanoplug")
# from this many constrained rows a step's masks are filled on the mask thread: a row or two fill in less time than
# handing them to the thread takes
MASKS_BESIDE_FROM = 4
NOTHING_TO_RUN = "the scheduler found nothing to run although requests wait; the KV cache is too small"


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prompt_tokens_total: int
    generated_tokens_total: int
    # speculative decoding (0 without a speculator): drafts proposed and kept, sequence-steps that verified any
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    running_adapters: list[str] = field(default_factory=list)  # per-request adapters of running / waiting
    waiting_adapters: list[str] = field(default_factory=list)  # requests (the gateway's lora_requests_info)


class EngineCore:
    """One checkpoint served by one worker (a device, or a proxy over tensor-parallel ranks)."""

    worker = None  # set once the worker starts; None again after close()

    def __init__(self, config: EngineConfig, registry: Registry | None = None):
        """config.model: a checkpoint folder, or a Hugging Face id (fetched where the network allows)."""
        started = time.perf_counter()
        self.registry = registry or default_registry()
        Speculation.check(self.registry, config)  # a bad speculator choice fails before anything loads
        wired = start(config, self.registry)
        self.config = config = wired.config
        self.hf_config, self.facts = wired.checkpoint.hf_config, wired.checkpoint.facts
        self.request_adapter_ids = wired.request_adapter_ids  # name -> slot; load_adapter and unload_adapter change it
        self.max_loras = max(config.max_loras, len(self.request_adapter_ids))  # per-request adapter slots
        self.adapter_loads = [0] * (self.max_loras + 1)  # per slot: how many times load_adapter filled it
        self.choices, self.device, self.dtype = wired.choices, wired.target.device, wired.target.dtype
        self.tokenizer, self.eos_token_ids = wired.tokenizer, wired.eos_token_ids
        self.worker, self.num_kv_blocks, self.overlap = wired.worker, wired.num_kv_blocks, wired.overlap
        self.structured = StructuredOutputs(*StructuredOutputs.resolve(self.registry, config.structured_output,
                                                                       wired.target),
                                            self.tokenizer, self.facts.vocab_size, self.eos_token_ids, self.device)
        self.tool_call_format = pick_tool_call_format(  # how this checkpoint writes tool calls (its template's)
            getattr(self.choices["model"].cls, "tool_call_formats", ()), getattr(self.tokenizer, "chat_template", None))
        # a worker that can sample after its launch (Worker.sample): a grammar's masks follow an overlapped launch
        self.defers_sampling = bool(getattr(self.worker, "defers_sampling", False))
        blocks = block_manager_for(wired.num_kv_blocks, config.kv_block_size, config.enable_prefix_caching,
                                   self.facts.sliding_windows, self.facts.num_layers)
        if config.speculator is not None and getattr(blocks, "groups", None) is not None:
            self.close()  # verification rows read one block table per sequence; KV groups keep one per group
            raise ConfigError(f"speculator {config.speculator!r} cannot serve a model whose layers mix sliding-window "
                              "and full attention (KV-cache groups): leave speculator unset for this model")
        self.scheduler = Scheduler(config, blocks)
        self.builder = BatchBuilder(self.scheduler.blocks, self.scheduler.penalty_slots, self.structured,
                                    self.defers_sampling)
        # a step's masks are filled on the mask thread: overlapped, while this one hands out the last step's tokens
        # and schedules and builds the next step; a step run to its end (a CPU's), while its forward runs
        # (NANOPLUG_MASKS_BESIDE=0: in line, for comparisons)
        self.masks_beside = self.defers_sampling and os.environ.get("NANOPLUG_MASKS_BESIDE") != "0"
        self.masks_due = False  # the launched step waits for masks begun on the mask thread (_sample_due)
        self.speculation = Speculation.resolve(self.registry, config, wired.target, self.facts.vocab_size,
                                               self.worker)  # None: no speculator
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self.requests: dict[str, RequestState] = {}  # every request added and not finished, by id
        self.in_flight: Launched | None = None  # overlapped: the launched step whose tokens are still to come
        self.last_step = (False, 0, 0)  # (is_prefill, tokens, sequences) of the last step resolved
        self._inbox: deque[tuple[str, Any]] = deque()  # ("add", EngineRequest) | ("abort", request_id)
        self._inbox_lock = threading.Lock()
        self._ids: set[str] = set()  # ids added and not finished (the inbox's included)
        self._tokenizer_lock = threading.Lock()  # make_request tokenizes while a step may detokenize
        self.request_maker = RequestMaker(self.tokenizer, self._tokenizer_lock, config.max_model_len,
                                          self.facts.vocab_size, self.request_adapter_ids)
        self.prompt_tokens_total = self.generated_tokens_total = 0
        report = self.worker.report()
        if report is not None:  # the worker's phases; the rest (config, tokenizer, starting processes) is the engine's
            log.info("engine ready in %.3f s; worker %s", time.perf_counter() - started, report.startup)

    # --------------------------------------------------------------------------- start-up
    def describe_plugins(self) -> list[str]:
        """One line per kind: what was asked, what was chosen, and why."""
        so = self.structured.resolution
        return self.choices.describe() + [so.describe() if so is not None else
                                          f"structured_output: asked 'auto', none ({self.structured.why_none})"] + (
            [self.speculation.describe()] if self.speculation is not None else [])

    # ---------------------------------------------------------------------------- requests
    def _check_open(self) -> None:
        if self.worker is None:
            raise EngineClosedError("this LLM was closed; create a new one: LLM(model, ...)")

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, *, index: int = 0,
                     incremental_text: bool = True) -> EngineRequest:
        """Tokenize and check one prompt and its SamplingParams (engine/requests.py); raises RequestError
        saying what is wrong. `index`: the prompt's place in the caller's list, for messages."""
        self._check_open()
        request = self.request_maker.make(prompt, params, request_id, index=index, incremental_text=incremental_text)
        if request.params.structured_outputs is not None:
            self.structured.check(request.params, f"prompt {index}")  # compiled now: a bad constraint is never queued
        return request

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request for the next step (any thread)."""
        self._check_open()
        with self._inbox_lock:
            if request.request_id in self._ids:
                raise RequestError(f"request id {request.request_id!r} is already in use; give each request its own")
            self._ids.add(request.request_id)
            request.arrived_at = time.monotonic()
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
                adapter = value.params.adapter
                if adapter is None or adapter in self.request_adapter_ids:
                    continue
                value = value.request_id  # its adapter was unloaded while it waited in the inbox: it ends ("abort")
            state = self.requests.get(value)
            if state is None:
                continue  # finished already, or never added: nothing to drop
            self.scheduler.abort(state.seq)  # every sample of it
            if self.speculation is not None:
                self.speculation.release([sample.seq.seq_id for sample in state.samples])
            updates += [self._sample_finished(s) for s in state.samples if not s.final_sent]
        return updates

    def _add(self, request: EngineRequest) -> None:
        p = request.params
        slot = self.request_adapter_ids.get(p.adapter, 0)
        seq = Sequence(list(request.prompt_token_ids), p, request_id=request.request_id, adapter_id=slot,
                       adapter_load=self.adapter_loads[slot], arrived_at=request.arrived_at)
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

    # ------------------------------------------------------------------ adapters at run time
    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA folder `path` per request as `name`, in a free slot (max_loras). Call it between
        steps (`Driver.between_steps`); raises AdapterError naming what does not fit, and then nothing changed."""
        self._check_open()
        if name in self.request_adapter_ids:
            raise AdapterError(f"an adapter named {name!r} is loaded already; unload it first or pick another name")
        used = set(self.request_adapter_ids.values()) | {state.seq.adapter_id for state in self.requests.values()}
        free = [slot for slot in range(1, self.max_loras + 1) if slot not in used]
        if not free:
            raise AdapterError(f"all {self.max_loras} adapter slots are taken (loaded, or used by requests still "
                               "running); unload one, or restart with more slots (max_loras, --max-loras)")
        self._sample_due()
        try:
            self.worker.load_adapter(free[0], AdapterSpec(path=path, name=name, merge=False))
        except NotImplementedError as exc:
            raise AdapterError(f"{exc}") from exc
        self.adapter_loads[free[0]] += 1
        self.request_adapter_ids[name] = free[0]

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`: new requests for it are refused; those running finish with it."""
        if self.request_adapter_ids.pop(name, None) is None:
            loaded = ", ".join(map(repr, self.request_adapter_ids)) or "none"
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {loaded})")

    # ---------------------------------------------------------------------------- stepping
    def step(self) -> list[RequestUpdate]:
        """Run one step: an update for every request that gained tokens or finished (aborted ones too).

        Overlapped (`overlap_steps`), a call launches the next step and then waits for the tokens of
        the one launched before it, so the device never waits for the host's bookkeeping. A
        sequence's newest token is then a placeholder that the device fills in; when that token
        ends the sequence (EOS, a stop string), the one step it ran ahead is thrown away."""
        self._check_open()
        updates = self._drain_inbox()
        if self.speculation is None:
            return updates + self._plain_step()
        k = self.speculation.num_drafts(self.scheduler)
        if k:
            return updates + self._speculative_step(k)
        started, before = time.perf_counter(), self.last_step
        updates += self._plain_step()
        # a decode step's time teaches the adaptive k; a call that only launched (the first plain step after
        # drafts) teaches nothing: the refill of the pipeline is paid once a switch, not by every plain step
        if self.last_step is not before and not self.last_step[0]:
            seqs = self.last_step[2]
            self.speculation.policy.observe(seqs, 0, seqs, time.perf_counter() - started)
        return updates

    def _plain_step(self) -> list[RequestUpdate]:
        """A step without drafts (overlapped where the engine overlaps)."""
        updates = []
        if not self.overlap:
            return self._step_to_end()
        launched = None
        if self.in_flight is not None and self.in_flight.masked and not self.defers_sampling:
            # a worker that cannot sample after its launch: a grammar's mask needs the step before it collected
            previous, self.in_flight = self.in_flight, None
            updates += self._apply(previous, self.worker.collect())
        if self.scheduler.has_work():
            batch, is_prefill = self.scheduler.schedule()
            if batch:
                self._start_forked()
                launched = self.builder.build(batch, is_prefill, self.in_flight)
                self._sample_due()  # the step before reads nothing of this one; this one reads its tokens
                self.worker.launch(launched.step)
                self.scheduler.advance(batch, pending=True)
                launched.number_rows()
        self._sample_due()
        previous, self.in_flight = self.in_flight, launched
        if previous is None:
            if launched is None and self.scheduler.has_work():
                raise RuntimeError(NOTHING_TO_RUN)
            self._sample_masked(launched)
            return updates
        updates += self._apply(previous, self.worker.collect(), then=lambda: self._sample_masked(launched))
        return updates

    def _speculative_step(self, k: int) -> list[RequestUpdate]:
        """A step that verifies up to `k` drafts per decoding sequence (engine/speculation.py), run to the end
        before the next is scheduled: the drafts come from every token known, and the accepted count decides
        where the next step starts. A step launched before it (overlapped) is collected first."""
        started, updates = time.perf_counter(), []
        policy = self.speculation.policy
        self._sample_due()
        if self.in_flight is not None:  # the plain step launched last, its wait its own (k = 0) figure
            previous, self.in_flight = self.in_flight, None
            updates += self._apply(previous, self.worker.collect())
            now = time.perf_counter()
            if not self.last_step[0]:
                policy.observe(self.last_step[2], 0, self.last_step[2], now - started)
            started = now
        accepted_before = self.speculation.stats.accepted_tokens
        updates += self._step_to_end(k)
        if not self.last_step[0]:
            seqs, accepted = self.last_step[2], self.speculation.stats.accepted_tokens - accepted_before
            policy.observe(seqs, k, seqs + accepted, time.perf_counter() - started)
        return updates

    def _step_to_end(self, k: int = 0) -> list[RequestUpdate]:
        """Schedule, run and apply one step before the next is scheduled: every step of an engine that does not
        overlap, and every speculative one (a decode step then verifies up to `k` drafts per sequence)."""
        if not self.scheduler.has_work():
            return []
        batch, is_prefill = self.scheduler.schedule()
        if not batch:
            raise RuntimeError(NOTHING_TO_RUN)
        self._start_forked()
        if k and not is_prefill:
            self.speculation.propose(batch, self.scheduler, k)
        launched = self.builder.build(batch, is_prefill, None)
        if launched.step.sampling.mask_later:  # the masks filled while the forward runs, then the step sampled
            # a CPU's forward runs inside launch: the fill goes beside it from the first row
            beside = self.masks_beside and (not self.overlap or len(launched.masked) >= MASKS_BESIDE_FROM)
            if beside:
                self.structured.begin(launched.masked)
            self.worker.launch(launched.step)
            self.worker.sample(self.structured.end() if beside else self.structured.masks(launched.masked))
            result = self.worker.collect()
        else:
            result = self.worker.run(launched.step)
        self.scheduler.advance(batch)
        return self._apply(launched, result)

    def _sample_masked(self, launched: Launched | None) -> None:
        """Structured outputs, overlapped: the launched step's forward runs while the previous step's tokens
        advanced the grammars; now its masks are filled on the host and it is sampled under them. Beside (from
        MASKS_BESIDE_FROM rows): the masks are begun on the mask thread and the step is sampled at the next
        `_sample_due`, once this thread has handed out the tokens and scheduled and built the next step."""
        if launched is None or not launched.step.sampling.mask_later:
            return
        if self.masks_beside and len(launched.masked) >= MASKS_BESIDE_FROM:
            self.structured.begin(launched.masked)
            self.masks_due = True
        else:
            self.worker.sample(self.structured.masks(launched.masked))

    def _sample_due(self) -> None:
        """Sample the launched step under the masks begun beside, before the worker is given anything else: the
        worker is handed the wait for them (`end`), which it makes once the next step's inputs are planned."""
        if self.masks_due:
            self.masks_due = False
            self.worker.sample(self.structured.end)

    def _apply(self, launched: Launched, result: StepResult, then: Callable[[], None] | None = None
               ) -> list[RequestUpdate]:
        """Give a finished step's tokens to their sequences, register full blocks, check for stops.

        `then`: called as soon as the tokens have advanced their grammars, before the rest of this Python (the
        next step's masks are begun from there, beside it)."""
        batch, step = launched.batch, launched.step
        self.last_step = (step.is_prefill, sum(step.query_lens), len(batch))
        logits_of, logprobs_of = launched.row_outputs(result)
        got, settled = launched.emitted(result)  # settled: a speculative step's accepted drafts per sample
        # one token a sequence (no drafts): every grammar advanced first, in one pass
        grammars_done = self._accept(got) if launched.masked and not settled else None
        if then is not None and not settled and not (
                self.speculation is not None and self.speculation.observes):  # (it reads the worker at the end)
            then, early = None, then
            early()
        drafted = {id(seq) for seq, _, _ in settled}  # their K/V past the accepted tokens is the rejected drafts'
        updates = []
        requests, outputs = self.requests, self.outputs
        with self._tokenizer_lock:
            for i, (seq, token, k) in enumerate(got):
                if seq.status is Status.FINISHED:
                    continue  # it ended at the step before, or at an earlier token of this one (or was aborted)
                self.scheduler.append_token(seq, token)
                self.generated_tokens_total += 1
                state = requests[seq.request_id]
                if seq.sample_index:
                    state = state.samples[seq.sample_index]
                if logits_of is not None and k in logits_of:
                    state.logits.append(logits_of[k])
                if logprobs_of is not None and k in logprobs_of:
                    state.logprobs.append(logprobs_of[k])
                reason = outputs.finish_reason(state, token)
                if seq.params.structured_outputs is not None:
                    done = grammars_done[i] if grammars_done is not None else self.structured.accept(seq, token)
                    if reason is None and done is not None:  # the grammar ended (even with ignore_eos), or broke
                        reason = done
                        if state.detok is not None:
                            state.detok.flush()
                if reason is not None:
                    if id(seq) not in drafted:  # its full blocks stay reusable by later prompts (freed, not lost)
                        self.scheduler.blocks.commit(seq)
                    self.scheduler.finish(seq, reason)
                    updates.append(self._sample_finished(state))
                elif state.incremental and (i == len(got) - 1 or got[i + 1][0] is not seq):
                    updates.append(outputs.update(state))  # (once per step: after a sequence's last token)
        for seq, num_accepted, _ in settled:
            if seq.status is Status.RUNNING:
                self.scheduler.settle_drafts(seq, num_accepted)
        if settled:
            self.speculation.settled(settled)
        self.scheduler.commit(batch)  # full blocks are registered once their tokens are known
        if self.speculation is not None and self.speculation.observes:  # (EAGLE) the step's hidden states
            self.speculation.observe(launched)
        if then is not None:
            then()
        return updates

    def _accept(self, got: list[tuple[Sequence, int, int]]) -> dict[int, str | None]:
        """Each constrained sequence's grammar advanced by its token (one a sequence), by index in `got`: what
        `StructuredOutputs.accept` said."""
        rows = [i for i, (seq, _, _) in enumerate(got)
                if seq.params.structured_outputs is not None and seq.status is not Status.FINISHED]
        said = self.structured.accept_many([got[i][0] for i in rows], [got[i][1] for i in rows]) if rows else []
        return dict(zip(rows, said))

    # ------------------------------------------------------------------------------ the rest
    def stats(self) -> EngineStats:
        blocks = self.scheduler.blocks
        running = waiting = []
        if self.request_adapter_ids:  # only an engine serving adapters per request pays for the walk
            names = {i: name for name, i in self.request_adapter_ids.items()}
            running = sorted({names[s.adapter_id] for s in self.scheduler.running if s.adapter_id in names})
            waiting = sorted({names[s.adapter_id] for s in self.scheduler.waiting if s.adapter_id in names})
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            kv_blocks_used=self.num_kv_blocks - blocks.num_free_blocks, kv_blocks_total=self.num_kv_blocks,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total, running_adapters=running, waiting_adapters=waiting,
            **(self.speculation.counters() if self.speculation is not None else {}),
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

    def close(self) -> None:
        """Stop the worker; safe to call twice."""
        self.masks_due = False
        self.structured.close()
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.shutdown()

