"""`LLM`: requests in, outputs and streams out.

Start-up resolves one plugin of each kind (the only time the registry is consulted), starts the
parallel strategy's workers, and builds the scheduler. Then each step is schedule -> run -> append
tokens and check stops.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence as Seq

import torch

from nanoplug.core.blocks import BlockManager
from nanoplug.core.chat_template import chat_token_ids
from nanoplug.core.config import EngineConfig, SamplingParams
from nanoplug.core.context_length import checked_max_model_len
from nanoplug.core.detokenizer import IncrementalDetokenizer
from nanoplug.core.errors import EngineClosedError, ModelLoadError, RequestError
from nanoplug.core.interfaces import ModelFacts, Target
from nanoplug.core.loader import checkpoint_dir, load_hf_config
from nanoplug.core.model_source import resolve_model_path
from nanoplug.core.registry import Registry, Resolution, default_registry
from nanoplug.core.request_input import params_list, prompt_list, token_ids
from nanoplug.core.runner import ModelRunner, PluginClasses, StepBatch
from nanoplug.core.sampler import SamplingBatch
from nanoplug.core.scheduler import Scheduled, Scheduler
from nanoplug.core.sequence import PENDING, Sequence, Status
from nanoplug.core.tokenizer import load_tokenizer

log = logging.getLogger("nanoplug")
NOTHING_TO_RUN = "the scheduler found nothing to run although requests wait; the KV cache is too small"


@dataclass
class RequestOutput:
    """The finished result of one prompt."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA GPU; use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    saved = getattr(torch, saved) if isinstance(saved, str) else saved
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16


class LLM:
    """An inference engine for one checkpoint: `LLM(path, attention="sdpa", kv_cache="torch", ...)`."""

    executor = None  # set once the workers start; None again after close()

    def __init__(self, model: str | os.PathLike, registry: Registry | None = None, **options: Any):
        unknown = sorted(set(options) - set(EngineConfig.model_fields))
        if unknown:
            raise TypeError(
                f"unknown option(s) {', '.join(map(repr, unknown))} for LLM; valid options: "
                + ", ".join(sorted(f for f in EngineConfig.model_fields if f != "model"))
            )
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model is a {type(model).__name__}; give a checkpoint folder (a str or pathlib.Path) "
                            "or a Hugging Face model id")
        config = EngineConfig(model=resolve_model_path(model), **options)
        self.registry = registry or default_registry()
        self.hf_config = load_hf_config(config.model)
        config.max_model_len = checked_max_model_len(config.max_model_len, "max_model_len" in options, self.hf_config,
                                                     str(checkpoint_dir(config.model) / "config.json"))
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.hf_config)
        self.config = config
        self._check_architecture()
        self.facts = ModelFacts.from_hf_config(self.hf_config)
        # per-request adapters (merge=False), by the name requests give: ids 1..K in config order, 0 = none
        self.request_adapter_ids = {spec.label: i for i, spec in enumerate((s for s in config.adapters if not s.merge), 1)}
        self.choices = self._resolve_plugins()
        self.tokenizer = self._load_tokenizer()
        self.eos_token_ids = self._eos_ids()
        plugins = PluginClasses(
            model=self.choices["model"].cls,
            prefill_attention=self.choices["prefill_attention"].cls,
            decode_attention=self.choices["attention"].cls,
            kv_cache=self.choices["kv_cache"].cls,
            adapters=[(r.cls, spec) for r, spec in zip(self.choices["adapters"], config.adapters)],
        )
        self.executor = self.choices["parallel"].cls(config)
        self.executor.start(_RunnerFactory(config, plugins, self.device, self.dtype))
        num_blocks = self.executor.call("kv_blocks")
        if num_blocks * config.kv_block_size < config.max_model_len:
            self.close()
            raise RuntimeError(
                f"the KV cache holds {num_blocks * config.kv_block_size} tokens, fewer than max_model_len "
                f"({config.max_model_len}); lower max_model_len or give the cache more memory"
            )
        self.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(config, BlockManager(num_blocks, config.kv_block_size, config.enable_prefix_caching))
        self.overlap = self._wants_overlap()
        self.in_flight: _Launched | None = None  # overlapped: the launched step whose tokens are still to come
        self.last_step = (False, 0, 0)  # (is_prefill, tokens, sequences) of the last step resolved

    # --------------------------------------------------------------------------- start-up
    def _wants_overlap(self) -> bool:
        """Overlapped steps: asked for, or by default on CUDA (on a CPU the host computes the step itself)."""
        asked = self.config.overlap_steps
        if not self.executor.supports_overlap:
            if asked:
                log.warning("parallel strategy %r cannot overlap steps; they run one after another",
                            self.choices["parallel"].name)
            return False
        return self.device.type == "cuda" if asked is None else asked

    def _check_architecture(self) -> None:
        """Name the supported architectures before reading fields an unknown config may not have."""
        arch = (getattr(self.hf_config, "architectures", None) or ["?"])[0]
        if arch not in self.registry.entries["model"]:
            raise ModelLoadError(
                f"architecture {arch!r} of {self.config.model!r} is not supported; supported architectures: "
                + ", ".join(self.registry.names("model"))
            )

    def _resolve_plugins(self) -> dict[str, Any]:
        cfg, reg = self.config, self.registry
        target = Target(cfg, self.device, self.dtype, self.facts)
        arch = self.facts.architecture
        choices: dict[str, Any] = {
            "model": reg.resolve("model", arch, target),
            "attention": reg.resolve("attention", cfg.attention, target),
            "kv_cache": reg.resolve("kv_cache", cfg.kv_cache, target),
            "parallel": reg.resolve("parallel", cfg.parallel, target),
            "adapters": [reg.resolve("adapter", spec.kind, target) for spec in cfg.adapters],
        }
        choices["prefill_attention"] = (
            reg.resolve("attention", cfg.prefill_attention, target) if cfg.prefill_attention else choices["attention"]
        )
        return choices

    def describe_plugins(self) -> list[str]:
        """One line per kind: what was asked, what was chosen, and why."""
        lines = []
        for key in ("model", "attention", "prefill_attention", "kv_cache", "parallel"):
            res: Resolution = self.choices[key]
            lines.append(res.describe().replace(res.kind, key, 1))
        lines += [r.describe() for r in self.choices["adapters"]]
        return lines

    def _load_tokenizer(self):
        """The checkpoint's tokenizer; None with skip_tokenizer_init (token-id prompts, outputs without text)."""
        if self.config.skip_tokenizer_init:
            return None
        return load_tokenizer(checkpoint_dir(self.config.model))

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

    # ---------------------------------------------------------------------------- requests
    def _check_open(self) -> None:
        if self.executor is None:
            raise EngineClosedError("this LLM was closed; create a new one: LLM(model, ...)")

    def _tokenize(self, index: int, prompt: Any) -> list[int]:
        ids = token_ids(index, prompt)
        if ids is not None:
            return ids
        if self.tokenizer is None:
            raise RequestError(f"prompt {index} is text, but this LLM has no tokenizer (skip_tokenizer_init=True); "
                               "give token ids, or create the LLM without skip_tokenizer_init")
        return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []

    def _make_sequences(self, prompts: Any, params: Any, single: bool = False) -> list[Sequence]:
        """Tokenize and check every prompt before any is queued: bad input never costs others their work.

        `single`: `prompts` is one prompt (stream's), whatever it looks like."""
        self._check_open()
        prompts = [prompts] if single else prompt_list(prompts)
        params = params_list(params, len(prompts))
        vocab = self.facts.vocab_size
        limit = self.config.max_model_len
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids = self._tokenize(i, prompt)
            if not ids:
                raise RequestError(f"prompt {i} is empty; give it at least one token")
            if len(ids) >= limit:
                raise RequestError(
                    f"prompt {i} has {len(ids)} tokens, but max_model_len is {limit} (room for the prompt and "
                    f"at least one new token); shorten the prompt or raise max_model_len"
                )
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
            self._check_params(i, p)
            seq = Sequence(ids, p, index=i, adapter_id=self.request_adapter_ids.get(p.adapter, 0))
            seq.prompt = prompt if isinstance(prompt, str) else None
            if p.stop:
                seq.detok = IncrementalDetokenizer(self.tokenizer, ids, p.stop)
            seqs.append(seq)
        return seqs

    def _check_params(self, index: int, params: SamplingParams) -> None:
        """Hook for request options that depend on the engine (e.g. per-request adapters)."""
        if params.stop and self.tokenizer is None:
            raise RequestError(f"prompt {index} has stop strings, but this LLM has no tokenizer "
                               "(skip_tokenizer_init=True) to read text; use stop_token_ids")
        if params.adapter is not None and params.adapter not in self.request_adapter_ids:
            loaded = ", ".join(map(repr, self.request_adapter_ids)) or "none"
            raise RequestError(
                f"prompt {index} asks for adapter {params.adapter!r}, but this engine serves per request: {loaded}; "
                "pick one of those, or load it with LLM(..., adapters=[{'path': DIR, 'name': NAME, 'merge': False}])"
            )

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

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Run one step; returns each sampled sequence with the tokens it gained.

        Overlapped (`overlap_steps`), a call launches the next step and then waits for the tokens of
        the one launched before it, so the device never waits for the host's bookkeeping. A
        sequence's newest token is then a placeholder that the device fills in; when that token
        ends the sequence (EOS, a stop string), the one step it ran ahead is thrown away."""
        self._check_open()
        if not self.overlap:
            batch, is_prefill = self.scheduler.schedule()
            if not batch:
                raise RuntimeError(NOTHING_TO_RUN)
            step = self._build_step(batch, is_prefill)
            tokens, logits = self.executor.call("run", step)
            self.scheduler.advance(batch)
            return self._resolve(_Launched(batch, step, {}), tokens, logits)
        launched = None
        if self.scheduler.has_work():
            batch, is_prefill = self.scheduler.schedule()
            if batch:
                step = self._build_step(batch, is_prefill)
                self.executor.call("launch", step)
                self.scheduler.advance(batch)
                row_of = {}
                for k, row in enumerate(step.sample_rows):
                    seq = batch[row].seq
                    seq.add_pending()
                    row_of[seq.seq_id] = k
                launched = _Launched(batch, step, row_of)
        previous, self.in_flight = self.in_flight, launched
        if previous is None:
            if launched is None:
                raise RuntimeError(NOTHING_TO_RUN)
            return []
        tokens, logits = self.executor.call("collect")
        return self._resolve(previous, tokens, logits)

    def _resolve(self, launched: "_Launched", tokens: list[int], logits: list[Any]) -> list[tuple[Sequence, list[int]]]:
        """Give a finished step's tokens to their sequences, register full blocks, check for stops."""
        batch, step = launched.batch, launched.step
        self.last_step = (step.is_prefill, sum(step.query_lens), len(batch))
        got = []
        logits_of = dict(zip(step.logits_rows, logits))
        for k, (row, token) in enumerate(zip(step.sample_rows, tokens)):
            seq = batch[row].seq
            if seq.status is Status.FINISHED:
                continue  # it ended at the step before: this one ran ahead for nothing
            seq.resolve_pending(token)
            if k in logits_of:
                seq.logits.append(logits_of[k])
            got.append((seq, token))
        for item in batch:  # full blocks are registered once their tokens are known
            if item.seq.status is Status.RUNNING:
                self.scheduler.blocks.commit(item.seq)
        for seq, token in got:
            self._check_finish(seq, token)
        return [(seq, [token]) for seq, token in got]

    def _drain(self, quiet: bool = False) -> None:
        """Collect the step still on the device, if any (the end of a generate call or stream).

        `quiet`: another error is on its way up; one from draining must not hide it."""
        previous, self.in_flight = self.in_flight, None
        if previous is None:
            return
        try:
            tokens, logits = self.executor.call("collect")
            self._resolve(previous, tokens, logits)
        except Exception:
            if not quiet:
                raise

    def _check_finish(self, seq: Sequence, token: int) -> None:
        """Stop on EOS or a stop token (left out of the text), a stop string (text cut before it), or length."""
        p, detok = seq.params, seq.detok
        reason, cut = None, None
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif detok is not None:
            detok.add(token)
            cut = detok.find_stop() if p.stop else None
            if cut is not None:
                detok.text, reason = detok.text[:cut], "stop"
        if reason is None and (seq.num_completion_tokens >= p.max_tokens or seq.num_known_tokens >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            if detok is not None and cut is None:
                detok.flush()  # the text ends here: keep even a partial character, as decode() of the ids does
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        if seq.detok is not None and seq.params.stop:
            return seq.detok.text
        ids = seq.completion_token_ids
        if seq.finish_reason == "stop" and ids and (ids[-1] in self.eos_token_ids or ids[-1] in seq.params.stop_token_ids):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            index=seq.index, prompt=seq.prompt, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            text=self._text(seq), token_ids=seq.completion_token_ids, finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens, logits=seq.logits,
        )

    # ------------------------------------------------------------------------------ public
    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt, batched continuously; one output per prompt, in order.

        A prompt is a string or token ids (ints, numpy/torch integers, a 1-d integer array); sampling_params
        is one SamplingParams (or dict of its fields) for all, one per prompt, or None for the defaults.
        Anything else is a RequestError that says what to pass (core/request_input.py)."""
        seqs = self._make_sequences(prompts, sampling_params)
        for seq in seqs:
            self.scheduler.add(seq)
        bar = _Progress(len(seqs)) if use_tqdm else None
        pending = {seq.seq_id for seq in seqs}
        try:
            while pending:
                start = time.perf_counter()
                done = [seq for seq, _ in self.step() if seq.status is Status.FINISHED]
                pending.difference_update(seq.seq_id for seq in done)
                if bar:
                    bar.update(self.last_step, time.perf_counter() - start, len(done))
            self._drain()
        except BaseException:
            self._drain(quiet=True)
            raise
        finally:
            if bar:
                bar.close()
            for seq in seqs:  # only when interrupted: its requests must not run on in later calls
                if seq.status is not Status.FINISHED:
                    self.scheduler.abort(seq)
        return [self._output(seq) for seq in seqs]

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield the text and token ids each step adds to one request, the last delta marked finished."""
        (seq,) = self._make_sequences(prompt, sampling_params, single=True)
        if seq.detok is None and self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, [])
        self.scheduler.add(seq)
        sent = 0
        try:
            while True:
                if seq.status is not Status.FINISHED:
                    self.step()
                finished = seq.status is Status.FINISHED
                tokens = seq.completion_token_ids[sent:]
                if tokens or finished:
                    sent += len(tokens)
                    text = seq.detok.take(final=finished) if seq.detok is not None else ""
                    yield StreamDelta(text, tokens, finished, seq.finish_reason)
                if finished:
                    self._drain()
                    return
        except BaseException:  # GeneratorExit included: the caller stopped reading
            self._drain(quiet=True)
            raise
        finally:
            if seq.status is not Status.FINISHED:  # the caller stopped early: free its blocks
                self.scheduler.abort(seq)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list of them) and generate."""
        self._check_open()
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = [self.chat_prompt_ids(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the checkpoint's chat template, as token ids. Text inside the messages
        never becomes a special token (see core/chat_template.py); the template's own tokens do."""
        if self.tokenizer is None:
            raise RequestError("chat needs the checkpoint's tokenizer and chat template, but this LLM was created "
                               "with skip_tokenizer_init=True; give generate() token ids instead")
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"the tokenizer of {self.config.model!r} has no chat template; use generate() with plain text")
        return chat_token_ids(self.tokenizer, messages)

    def close(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
            self.executor = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@dataclass
class _Launched:
    """A step handed to the device: its schedule, its inputs, and each sampled sequence's row."""

    batch: list[Scheduled]
    step: StepBatch
    row_of: dict[int, int]  # seq_id -> row of the step's sampled tokens


class _RunnerFactory:
    """Builds the model runner on a rank (picklable, so process-based strategies can ship it)."""

    def __init__(self, config: EngineConfig, plugins: PluginClasses, device: torch.device, dtype: torch.dtype):
        self.config, self.plugins, self.device, self.dtype = config, plugins, device, dtype

    def __call__(self, group) -> ModelRunner:
        device = self.device
        if device.type == "cuda" and group.world_size > 1:
            device = torch.device("cuda", group.local_rank)
            torch.cuda.set_device(device)
        return ModelRunner(self.config, self.plugins, group, device, self.dtype)


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
