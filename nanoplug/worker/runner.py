"""The worker on one device: build the model once, then per step plan the inputs, run the model, sample.

It implements the worker protocol (`nanoplug.api.Worker`) and lives on every tensor-parallel rank.
It is built once with the engine's resolved plugin classes, so nothing per step goes through the
registry or pluggy, and it holds no device-family code: sizing and zeroing the KV cache, fused
kernels, compiled ops, warm-up, graphs and the copy of the tokens back are its platform's.

It owns what it says about itself (`report()`): the seconds of each start-up phase, why graphs it was
to capture failed, and what each decode step ran as (a counter per step, nothing more), so a test
or an operator can see that a graph-enabled engine never falls back to eager.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from nanoplug.api import (AdapterError, AttentionMetadata, AttentionSpec, GraphCaptureError, HiddenStateSource,
                          KVCacheSpec, Layers, LinearMethod,
                          LogprobsTensors, ModelFacts, PagedAttention, ProcessGroup, PromptLogprobsBatch, SamplingBatch,
                          StartupTimes, StepBatch, StepContext, StepInputs, StepLimits, StepResult, StepStats, Target,
                          Worker, WorkerReport, to_device)
from nanoplug.api.step import kv_groups
from nanoplug.worker import logprobs
from nanoplug.worker.graph_agreement import capture_failures, describe
from nanoplug.config import EngineConfig
from nanoplug.worker.inputs import plan_fresh_prefill, plan_inputs
from nanoplug.checkpoint.loader import load_weights
from nanoplug.worker.sampler import Sampler

log = logging.getLogger("nanoplug")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype of each size, to zero any cache


@dataclass
class PluginClasses:
    """The engine's resolved plugin classes (resolved once, by name, at start-up)."""

    model: Any
    prefill_attention: Any
    decode_attention: Any
    kv_cache: Any
    adapters: list[Any]  # (class, AdapterSpec) pairs
    platform: Any
    platform_name: str
    platform_options: Any  # an instance of the platform's Options, validated by the engine
    weight_format: Any = None  # None: the platform's dense method (as the `dense` format gives)
    request_adapter: Any = None  # the adapter class of adapters loaded per request at run time (max_loras)


@dataclass
class WorkerSpec:
    """Everything a worker is built from (picklable: process-based strategies ship it to each rank)."""

    config: EngineConfig
    plugins: PluginClasses
    hf_config: Any  # the checkpoint's config, read once by the engine
    facts: ModelFacts
    target: Target
    extra_kv_layers: int = 0  # layers of K/V in the model's block geometry kept beside it (a speculator's): sized for


class RunnerFactory:
    """Builds the model runner on a rank: `factory(group)`."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec

    def __call__(self, group: ProcessGroup) -> "ModelRunner":
        return ModelRunner(self.spec, group)


class ModelRunner(Worker):
    defers_sampling = True  # `sample(bitmask)` completes a step launched with sampling.mask_later
    graphs: Any = None  # the platform's captured decode graphs; None (eager) until captured after warm-up
    graphs_error: str | None = None  # why graphs the platform was asked for could not be captured
    graph_limit = 0  # decode steps of up to this many sequences should replay a graph (else: eager by design)
    hidden_layers = None  # keep_hidden_states: gives the last forward's hidden states at the layers asked for

    def __init__(self, spec: WorkerSpec, group: ProcessGroup):
        started = self._clock = time.perf_counter()
        config, plugins, facts = spec.config, spec.plugins, spec.facts
        self.config, self.group, self.facts = config, group, facts
        self.extra_kv_layers = spec.extra_kv_layers
        self._adapter_context = (plugins, facts, spec.hf_config)  # for adapters loaded at run time
        self.platform = plugins.platform(plugins.platform_options, spec.target)
        self.device = device = self.platform.worker_device(spec.target.device, group)
        self.dtype = dtype = spec.target.dtype
        self.block_size = config.kv_block_size
        self.limits = StepLimits(config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
                                 config.kv_block_size,
                                 max_decode_rows=config.max_num_seqs * spec.target.decode_query_len)
        heads = facts.num_heads // group.world_size
        kv_heads = facts.num_kv_heads // group.world_size
        store = plugins.kv_cache()
        self.kv_spec = KVCacheSpec(store.cache_dtype(dtype), self.block_size, kv_heads, facts.head_dim,
                                   facts.num_layers)
        scales = store.scales(self.kv_spec)
        if scales is not None:  # kernels read them on the device
            k_scale, v_scale = (s.to(device, torch.float32) for s in scales)
            self.kv_spec = dataclasses.replace(self.kv_spec, k_scale=k_scale, v_scale=v_scale)
        spec_ = AttentionSpec(heads, kv_heads, facts.head_dim, facts.head_dim ** -0.5, self.block_size, dtype, device,
                              self.kv_spec, self.limits, facts.sliding_windows, facts.attn_softcap)
        # a model whose layers mix windows keeps its KV cache in groups (api/step.py KVGroups): each group's layers
        # read their own block tables, through backends of their own (a backend's per-step state is one table's)
        self.kv_groups = kv_groups(facts.sliding_windows, facts.num_layers)
        self.group_ctxs = []
        for _ in self.kv_groups.windows:
            decode = plugins.decode_attention(spec_)
            prefill = decode if plugins.prefill_attention is plugins.decode_attention else plugins.prefill_attention(spec_)
            self.group_ctxs.append(StepContext(store=store, prefill=prefill, decode=decode))
        self.ctx, decode = self.group_ctxs[0], self.group_ctxs[0].decode

        def attention_factory(layer_idx, num_heads, num_kv_heads, head_dim):
            ctx = self.group_ctxs[self.kv_groups.layer_group[layer_idx]]
            return PagedAttention(ctx, layer_idx, num_heads, num_kv_heads, head_dim)

        adapters = [cls(aspec, facts, spec.hf_config) for cls, aspec in plugins.adapters]
        weight_format = plugins.weight_format(spec.target, spec.hf_config) if plugins.weight_format else None
        method = self._linear_method(weight_format)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = plugins.model(spec.hf_config, Layers(group, method), attention_factory,
                                           config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(self.model, config.model, adapters, weight_format)
        for module in self.model.modules():  # after the LoRA merges, which change the weights
            if getattr(module, "linear_method", None) is method:
                method.process_after_loading(module)
        per_request = [a for a in adapters if not a.spec.merge]  # ids 1..K in config order, as the engine numbers them
        adapter_class = type(per_request[0]) if per_request else plugins.request_adapter
        self.request_adapters = adapter_class.serve_per_request(
            self.model, per_request, group, max(config.max_num_batched_tokens, config.max_num_seqs),
            config.max_loras, config.max_lora_rank) if per_request or config.max_loras else None
        self.model.eval()
        self.sampler = Sampler(device, config.seed, greedy=self.platform.greedy_sampler(),
                               temperature=self.platform.temperature_sampler(), masker=self.platform.grammar_masker(),
                               grammar_draw=self.platform.grammar_sampler(),
                               inverse_cdf=self.platform.inverse_cdf_sampler())
        self.pending: deque = deque()  # launched steps whose tokens are not collected yet
        self.unsampled = None  # a step launched with sampling.mask_later, waiting for `sample`
        self.bitmask_due: Callable[[], Any] | None = None  # `sample`'s call for the bitmask, made at the next launch
        self.last_tokens: torch.Tensor | None = None
        self.stats = StepStats()
        load = self._lap()
        self.num_blocks = self._allocate_kv_cache()
        self.scratch_block = self.num_blocks  # the block past those the engine hands out (api/step.py)
        kv_cache = self._lap()
        self.platform.prepare_model(self.model)
        compile_ = self._lap()
        self.platform.warm_up(self.run, self.limits, self.num_blocks)
        warm_up = self._lap()
        self._capture_graphs(plugins.platform_name, decode)
        graphs = self._lap()
        self.startup = StartupTimes(load, kv_cache, compile_, warm_up, graphs, total_s=self._clock - started)
        self.stats = StepStats()  # the steps of start-up (profiling, warm-up) are not counted

    def _lap(self) -> float:
        """Start-up's phase clock: seconds since the last lap, once the device has run what was queued."""
        self.platform.synchronize()
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        return seconds

    def _capture_graphs(self, platform_name: str, decode: Any) -> None:
        """Decode graphs where the decode backend and the adapters allow them and the platform takes them. A
        failed capture is recorded (`graphs_error`, a warning) and decode runs eager, each decode step then
        counted as one a graph should have served; the platform's `require_graphs` makes it an error."""
        strict = self.platform.require_graphs
        option = f"{platform_name}.require_graphs"
        adapters_eager = self.request_adapters is not None and not self.request_adapters.graph_safe
        if self.kv_groups.hybrid:  # each group's tables would need buffers of their own in every graph
            if strict:
                raise GraphCaptureError(f"{option} asks for decode graphs, but this model's layers mix sliding windows "
                                        f"and full attention, whose KV groups run eager; drop {option}")
            return
        if not decode.supports_cuda_graphs or adapters_eager:
            if strict:
                why = (f"the decode attention backend ({type(decode).__name__}) cannot run under graphs (its "
                       "supports_cuda_graphs is False); choose one that can" if not decode.supports_cuda_graphs else
                       f"the adapters served per request ({type(self.request_adapters).__name__}) cannot run under "
                       "graphs here (graph_safe is False); merge them (merge=True)")
                raise GraphCaptureError(f"{option} asks for decode graphs, but {why}, or drop {option}")
            return
        error = None
        try:
            # small fresh prefills too, where the prefill backend can be captured and no adapter is picked per token
            prefill = self._prefill_forward if (self.ctx.prefill.supports_prefill_graphs
                                                and self.request_adapters is None) else None
            self.graphs = self.platform.capture_graphs(self._forward, self.ctx, self.limits, self.scratch_block,
                                                       prefill)
        except GraphCaptureError as exc:
            error = exc
        failures = capture_failures(self.group, None if error is None else str(error), self.device)
        if failures:  # on any rank: every rank decodes eager (graph_agreement.py)
            self.graphs, why = None, describe(failures, self.group.world_size)
            if strict:
                raise GraphCaptureError(f"{why}. {option} stops start-up on it; without it decode runs eager") from error
            self.graphs_error = why
            self.graph_limit = self.limits.decode_rows
            log.warning("decode steps run eager (%s makes this an error): %s", option, why)
            return
        if self.graphs is None:
            if strict:
                raise GraphCaptureError(f"{option} asks for decode graphs, but platform {platform_name!r} captured "
                                        "none (its other options turn them off); drop one of the two")
            return
        self.graph_limit = max((n for n in range(1, self.limits.decode_rows + 1)
                                if self.graphs.size_for(n) is not None), default=0)

    def _linear_method(self, weight_format: Any) -> LinearMethod:
        """The weight format's method, or the platform's dense one where it gives none (`dense`)."""
        method = weight_format.linear_method() if weight_format is not None else None
        return method if method is not None else self.platform.linear_method()

    # ---------------------------------------------------------------------------- KV cache
    def _block_bytes(self) -> int:
        s = self.kv_spec
        return 2 * self.kv_groups.num_slots * s.block_size * s.num_kv_heads * s.head_dim * s.dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        """Size the cache (fixed, or the platform's way) and allocate it with one scratch block at the end."""
        if self.config.num_kv_blocks is not None:
            # the memory of that many blocks of every layer: under KV groups a block holds num_slots layers' pages
            num_blocks = self.config.num_kv_blocks * self.kv_spec.num_layers // self.kv_groups.num_slots
        else:  # a speculator's layers (extra_kv_layers) take a block's worth of one slot each beside the model's
            one_slot = self._block_bytes() // self.kv_groups.num_slots
            num_blocks = self.platform.num_kv_blocks(self._block_bytes() + self.extra_kv_layers * one_slot,
                                                     self._profile_run, self._release_cache)
        if self.group.world_size > 1:  # every rank must hold the same blocks: the fewest any rank has room for
            num_blocks = int(self.group.all_gather(torch.tensor([num_blocks], device=self.device), dim=0).min())
        self._set_cache(num_blocks + 1)
        return num_blocks

    def _set_cache(self, num_blocks: int) -> None:
        s = self.kv_spec
        # one cache tensor per slot: a layer each, or under KV groups the layers of one rank in every group
        shape = (2, self.kv_groups.num_slots, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        kv = self.platform.allocate_kv_cache(shape, s.dtype, self.device)
        kv[:, :, -1].zero_()  # the scratch block: padded reads see it (masked, but 0 * NaN garbage is NaN)
        self.kv_cache = kv
        store, slot = self.ctx.store, self.kv_groups.layer_slot
        layers = [(kv[0, slot[i]], kv[1, slot[i]], store.layer(i, s, self.device, self.dtype)) for i in range(s.num_layers)]
        for ctx in self.group_ctxs:
            ctx.kv = layers


    def _profile_run(self) -> None:
        """The largest prefill, once, on a small temporary cache (for platforms that size the cache from memory)."""
        cfg, bs = self.config, self.block_size
        n = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        seq_len = min(n, cfg.max_model_len)
        num_seqs = max(1, n // seq_len)
        per_seq = (seq_len + bs - 1) // bs
        self._set_cache(num_seqs * per_seq + 1)
        self.scratch_block = num_seqs * per_seq
        self.run(StepBatch(
            is_prefill=True, input_ids=[0] * (num_seqs * seq_len), starts=[0] * num_seqs,
            query_lens=[seq_len] * num_seqs,
            block_tables=[list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)],
            sample_rows=list(range(num_seqs)), sampling=SamplingBatch.greedy(num_seqs),
        ))

    def _release_cache(self) -> None:
        del self.kv_cache
        for ctx in self.group_ctxs:
            ctx.kv = []

    # ----------------------------------------------------------------------------------- step
    def run(self, step: StepBatch) -> StepResult | None:
        """Compute one step; rank 0 returns the sampled tokens and the requested logits rows."""
        self._launch(step, share_tokens=False)  # the engine waits for the tokens: no step reads them on the device
        return self.collect()

    def launch(self, step: StepBatch) -> None:
        """Queue one step's device work (model, sampler, the copy of the tokens back) without waiting.

        The host may then prepare the next step while the device computes this one; `collect`
        waits for the tokens. At most one step may be uncollected when the next is launched (the
        graph inputs' pinned host buffers come in two, used in turn). With several ranks, every rank
        gets rank 0's sampled tokens on its device, since the next step may take its inputs from them."""
        self._launch(step, share_tokens=self.group.world_size > 1)

    @torch.inference_mode()
    def _launch(self, step: StepBatch, share_tokens: bool) -> None:
        num_seqs = len(step.query_lens)
        # never-written memory may hold NaN that padded reads would spread, unless the platform zeroed it
        if step.new_blocks and not self.platform.kv_cache_zeroed:
            blocks = to_device(step.new_blocks, torch.int64, self.device)
            self.kv_cache.view(_BITS[self.kv_cache.dtype.itemsize]).index_fill_(2, blocks, 0)  # float8 has no fill
        size = prefill_size = None
        if self.graphs is not None and not step.is_prefill:
            size = self.graphs.size_for(num_seqs)
        elif self.graphs is not None and self.graphs.prefill is not None and not (
                any(step.starts) or step.prompt_logprobs or step.from_previous_at):
            # fresh prefills only: no cached context, no prompt scoring, every token known on the host
            prefill_size = self.graphs.prefill.size_for(len(step.input_ids), num_seqs)
        if not step.is_prefill:  # what the decode step runs as (StepStats)
            if size is not None:
                self.stats.graph_replays += 1
            elif num_seqs <= self.graph_limit:
                self.stats.eager_decode_steps += 1
            else:
                self.stats.eager_decode_steps_by_design += 1
        prompt_lps = None
        # warm-up and profiling (their outputs are dropped): one table for every group, whose layers then share pages
        if self.kv_groups.hybrid and not step.group_block_tables:
            step.group_block_tables = [step.block_tables] * (len(self.kv_groups.windows) - 1)
        if self.request_adapters is not None:
            ids = np.asarray(step.adapter_ids or [0] * num_seqs, dtype=np.int64)
            self.request_adapters.set_step(torch.from_numpy(np.repeat(ids, step.query_lens)))
        if prefill_size is not None:
            self.stats.prefill_graph_replays += 1
            graphs = self.graphs.prefill
            inputs = plan_fresh_prefill(step, self.block_size, self.scratch_block, graphs.inputs(prefill_size),
                                        prefill_size)
            self._sample_due()
            logits = _sampled_rows(graphs.replay(prefill_size, inputs), step.sample_rows, num_seqs)
        elif size is not None:
            inputs = plan_inputs(step, self.block_size, self.scratch_block, out=self.graphs.inputs(size), rows=size)
            self._sample_due()
            logits = _sampled_rows(self.graphs.replay(size, inputs, self.last_tokens), step.sample_rows, num_seqs)
        else:
            inputs = plan_inputs(step, self.block_size, self.scratch_block)
            self._sample_due()
            input_ids, positions, meta = self._to_device(step.is_prefill, inputs)
            if inputs.num_from_previous:
                at = to_device(inputs.from_previous_at, torch.int64, self.device)
                rows = to_device(inputs.from_previous_rows, torch.int64, self.device)
                input_ids.index_copy_(0, at, self.last_tokens.index_select(0, rows))
            self.ctx.set_step(meta)
            if inputs.group_block_tables:  # a hybrid model's KV groups 1..
                self._set_group_steps(meta, inputs)
            hidden = self.model(input_ids, positions)
            if self.hidden_layers is not None:  # a hidden-state speculator reads this step's rows (keep_hidden_states)
                self.kept_hidden.append((step, torch.cat(self.hidden_layers(), dim=-1), positions, meta.slot_mapping))
            if step.sample_rows:
                last = inputs.cu_seqlens_q[1:][step.sample_rows].astype(np.int64) - 1
                logits = self.model.compute_logits(hidden[to_device(last, torch.int64, self.device)])
            if step.prompt_logprobs is not None:
                prompt_lps = self._prompt_logprobs(hidden, step.prompt_logprobs)
        if step.block_copies:  # after the forward that wrote the blocks copied
            src, dst = zip(*step.block_copies)
            bits = self.kv_cache.view(_BITS[self.kv_cache.dtype.itemsize])  # float8 has no index_copy_
            bits.index_copy_(2, to_device(dst, torch.int64, self.device),
                             bits.index_select(2, to_device(src, torch.int64, self.device)))
        if step.sampling.mask_later and step.sample_rows:  # the grammars' bitmask comes with `sample`
            self.unsampled = (step, logits, prompt_lps, share_tokens)
            return
        self._sample_and_send(step, logits if step.sample_rows else None, prompt_lps, share_tokens)

    @torch.inference_mode()
    def sample(self, bitmask: Any) -> None:
        """Sample the step launched with `sampling.mask_later`, under the bitmask the engine computed on the
        host while that step's forward ran (structured outputs); then it is collected as any launched step.
        A call that returns the bitmask is made once the next launch's inputs are planned (or at the next
        collect): the wait for the mask thread overlaps that host work."""
        if callable(bitmask):
            self.bitmask_due = bitmask
            return
        (step, logits, prompt_lps, share_tokens), self.unsampled = self.unsampled, None
        step.sampling.bitmask = bitmask
        self._sample_and_send(step, logits, prompt_lps, share_tokens)

    def _sample_and_send(self, step: StepBatch, logits: torch.Tensor | None, prompt_lps: LogprobsTensors | None,
                         share_tokens: bool) -> None:
        """Sample the step's rows, keep the tokens for the next step, and start their copy to the host."""
        tokens = accepted = None
        if step.sample_rows:
            if self.group.rank == 0 and step.drafts is not None:  # a speculative step: the rejection sampler
                tokens, accepted = self.sampler(logits, step.sampling, step.drafts)
            elif self.group.rank == 0:
                tokens = self.sampler(logits, step.sampling)
            if share_tokens:
                tokens = self._shared_tokens(tokens, len(step.sample_rows))
            self.last_tokens = tokens  # the next step may read its inputs from here
        if self.group.rank != 0 or not (step.sample_rows or step.prompt_logprobs):
            self.pending.append(None)
            return
        if tokens is None:  # a prompt chunk that only scores prompt tokens
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        # both read the logits before a replay overwrites them
        rows = logits[step.logits_rows].float() if step.logits_rows else None
        lps = self.sampler.logprobs(logits, tokens, step.sampling) if step.sampling.logprob_rows else None
        extra = [t.pack() for t in (lps, prompt_lps) if t is not None]
        extra = self.platform.to_host(torch.cat(extra), None) if extra else None
        sent = tokens if accepted is None else torch.cat([tokens, accepted.long()])  # one copy back for both
        self.pending.append((self.platform.to_host(sent, rows), extra, step))

    def _shared_tokens(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """Rank 0's sampled tokens on every rank's device, queued there like any step work: a sum of
        rank 0's tokens and the other ranks' zeros (the group's reduction serves as a broadcast)."""
        if tokens is None:
            tokens = torch.zeros(count, dtype=torch.int64, device=self.device)
        return self.group.all_reduce(tokens.long())

    def _prompt_logprobs(self, hidden: torch.Tensor, scored: PromptLogprobsBatch) -> LogprobsTensors | None:
        """Logprobs of the prompt tokens this step scores, a few hundred positions at a time (every rank
        computes the logits, since the LM head may gather them; rank 0 keeps the logprobs)."""
        at = to_device(scored.at, torch.int64, self.device)
        ids = to_device(scored.token_ids, torch.int64, self.device)
        parts = []
        for i in range(0, len(scored.at), logprobs.ROWS_PER_PASS):
            part = slice(i, i + logprobs.ROWS_PER_PASS)
            logits = self.model.compute_logits(hidden.index_select(0, at[part]))
            if self.group.rank == 0:
                parts.append(logprobs.compute(logits, ids[part], scored.top))
        return LogprobsTensors.cat(parts) if parts else None

    def _to_device(self, is_prefill: bool, inputs: StepInputs):
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=is_prefill,
            cu_seqlens_q=to_device(inputs.cu_seqlens_q, torch.int32, dev),
            cu_seqlens_k=to_device(inputs.cu_seqlens_k, torch.int32, dev),
            seq_lens=to_device(inputs.seq_lens, torch.int32, dev),
            slot_mapping=to_device(inputs.slot_mapping, torch.int64, dev),
            block_tables=to_device(inputs.block_tables, torch.int32, dev),
            max_seqlen_q=inputs.max_seqlen_q,
            max_seqlen_k=inputs.max_seqlen_k,
            query_lens_host=inputs.query_lens_host,
            seq_lens_host=inputs.seq_lens_host,
        )
        return to_device(inputs.input_ids, torch.int64, dev), to_device(inputs.positions, torch.int64, dev), meta

    def _set_group_steps(self, meta: AttentionMetadata, inputs: StepInputs) -> None:
        """Each other KV group's backends get the step with that group's block tables and slots."""
        for ctx, tables, slots in zip(self.group_ctxs[1:], inputs.group_block_tables, inputs.group_slot_mappings):
            ctx.set_step(dataclasses.replace(meta, block_tables=to_device(tables, torch.int32, self.device),
                                             slot_mapping=to_device(slots, torch.int64, self.device)))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every position's logits (the step context already set): what a graph captures."""
        return self.model.compute_logits(self.model(input_ids, positions))

    def _prefill_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The logits at `rows` (each sequence's last token): what a captured prefill computes."""
        return self.model.compute_logits(self.model(input_ids, positions).index_select(0, rows))

    def _sample_due(self) -> None:
        """The sampling `sample` left to a call for its bitmask, before any device work that follows it."""
        if self.bitmask_due is not None:
            due, self.bitmask_due = self.bitmask_due, None
            self.sample(due())

    def collect(self) -> StepResult | None:
        """Wait for the oldest launched step's tokens (rank 0; None on other ranks)."""
        self._sample_due()
        entry = self.pending.popleft()
        if self.group.rank != 0:
            return None
        if entry is None:
            return StepResult([], [])
        (tokens, rows, handle), extra, step = entry
        self.platform.wait(handle)
        result = StepResult(tokens.tolist(), list(rows) if rows is not None else [])
        if step.drafts is not None:  # the tokens, then whether each draft row kept its draft
            n = len(step.sample_rows)
            result.tokens, result.accepted = result.tokens[:n], [bool(a) for a in result.tokens[n:]]
        if extra is not None:
            flat, _, extra_handle = extra
            self.platform.wait(extra_handle)
            result.logprobs, result.prompt_logprobs = _unpack_logprobs(flat, step)
        return result

    def load_adapter(self, adapter_id: int, spec: Any) -> None:
        if self.request_adapters is None:
            raise AdapterError("this engine serves no adapters per request; start it with max_loras > 0")
        plugins, facts, hf_config = self._adapter_context
        cls = plugins.request_adapter or next(c for c, a in plugins.adapters if not a.merge)
        self.request_adapters.load(adapter_id, cls(spec, facts, hf_config))

    def num_kv_blocks(self) -> int:
        return self.num_blocks

    # ------------------------------------------------------------------ hidden states for a speculator
    def keep_hidden_states(self, layer_ids: list[int]) -> HiddenStateSource:
        """From now on keep each step's hidden states at `layer_ids` on the device (a hidden-state speculator's
        `SpeculatorSpec.hidden_states`), for the last two steps launched (one may be in flight, overlapped). Steps
        then run eager: a captured graph would hand back its own buffers, rewritten by the next replay."""
        if self.group.world_size > 1:
            raise ValueError("a speculator over hidden states runs in the worker's process: use parallel='single'")
        bad = [i for i in layer_ids if not 0 <= i <= self.facts.num_layers]
        if bad:
            raise ValueError(f"hidden-state layer ids {bad} are outside 0..{self.facts.num_layers} (this target's "
                             "layers; id num_layers is the last layer's output)")
        kept = self.model.keep_hidden_states(list(layer_ids))
        if kept is None:
            raise ValueError(f"model {type(self.model).__name__} cannot hand its hidden states to a speculator")
        self.hidden_layers, self.kept_hidden = kept, deque(maxlen=2)
        if self.graphs is not None:
            log.info("decode graphs dropped: a speculator reads the hidden states of every step (eager steps)")
        self.graphs, self.graph_limit = None, 0
        return HiddenStateSource(self.device, self.dtype, self.facts.num_layers, self.facts.hidden_size,
                                 self.facts.vocab_size, self.block_size, self.num_blocks + 1, self.config.max_model_len,
                                 self.model.embed)

    def hidden_states(self, step: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [rows, layers * hidden_size], positions, slots) of a step launched since keep_hidden_states, on
        the device."""
        for kept, hidden, positions, slots in self.kept_hidden:
            if kept is step:
                return hidden, positions, slots
        raise KeyError("the hidden states of this step are no longer kept (only the last two launched are)")

    def report(self) -> WorkerReport:
        return WorkerReport(self.startup, dataclasses.replace(self.stats), self.graphs_error,
                            self.graphs.captures if self.graphs is not None else 0)

    def shutdown(self) -> None:
        """Drop the device state (graphs first: their pools hold the cache and activations they captured),
        then let the platform give the memory back. Safe to call twice."""
        self.pending.clear()
        self.unsampled = self.bitmask_due = None
        self.graphs = self.last_tokens = self.request_adapters = self.hidden_layers = None
        self.kept_hidden = ()
        for ctx in self.group_ctxs:
            ctx.kv = []
        self.kv_cache = self.model = None
        self.platform.release()


def _sampled_rows(logits: torch.Tensor, sample_rows: list[int], num_seqs: int) -> torch.Tensor:
    """A replay's logits (one row per sequence, then padding rows) in the order the step samples them."""
    if sample_rows == list(range(num_seqs)):
        return logits[:num_seqs]  # a view: no gather on the common path
    return logits[:num_seqs][sample_rows]


def _unpack_logprobs(flat: torch.Tensor, step: StepBatch) -> tuple[LogprobsTensors | None, LogprobsTensors | None]:
    """The step's sampled-token and prompt logprobs from the one host tensor `launch` packed them into."""
    out, scored = [], step.prompt_logprobs
    for rows, k in ((len(step.sampling.logprob_rows), max(step.sampling.num_top_logprobs, default=0)),
                    (len(scored.at), scored.top) if scored is not None else (0, 0)):
        if not rows:
            out.append(None)
            continue
        size = 2 * rows * (1 + k)
        out.append(LogprobsTensors.unpack(flat[:size], rows, k))
        flat = flat[size:]
    return out[0], out[1]
