"""One step on the device: pack the scheduled tokens into tensors, run the model, sample.

The runner lives on every tensor-parallel rank; it is built once with the engine's resolved
plugin classes, so nothing per step goes through the registry or pluggy.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nanoplug import cpu_kernels
from nanoplug.core.attention_layer import PagedAttention, StepContext
from nanoplug.core.config import EngineConfig
from nanoplug.core.device_copy import to_device
from nanoplug.core.interfaces import AttentionMetadata, AttentionSpec, ModelFacts, ProcessGroup, Worker
from nanoplug.core.loader import load_hf_config, load_weights
from nanoplug.core.packed_linear import pack_linear_weights
from nanoplug.core import logprobs
from nanoplug.core.sampler import Sampler, SamplingBatch

log = logging.getLogger("nanoplug")
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class StepBatch:
    """One step's work as plain data (it crosses process boundaries under tensor parallelism)."""

    is_prefill: bool
    input_ids: list[int]
    starts: list[int]  # tokens already in the cache for each sequence
    query_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # sequences whose last computed token yields a new token
    sampling: SamplingBatch
    logits_rows: list[int] = field(default_factory=list)  # of sample_rows, the ones that want logits
    adapter_ids: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)  # KV blocks used for the first time: cleared first
    # input tokens not yet known on the host (overlapped steps): input_ids[i] for i in from_previous_at
    # is row from_previous_rows[k] of the previous step's sampled tokens, taken on the device
    from_previous_at: list[int] = field(default_factory=list)
    from_previous_rows: list[int] = field(default_factory=list)
    # (from, to) KV blocks copied after this step's forward: a prompt's partly filled last block, for the
    # other samples of an n > 1 request (see BlockManager.fork). sample_rows then repeats that sequence
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # prompt logprobs: the input positions whose logits score the next prompt token, that token, and the
    # most alternatives any of them asked for
    prompt_logprob_at: list[int] = field(default_factory=list)
    prompt_logprob_ids: list[int] = field(default_factory=list)
    prompt_logprob_top: int = 0


@dataclass
class StepResult:
    """What rank 0 gives back for one step (host values)."""

    tokens: list[int]  # one per sample row
    logits: list[Any] = field(default_factory=list)  # the raw logits rows of `logits_rows`
    logprobs: logprobs.LogprobsTensors | None = None  # of sampling.logprob_rows' tokens
    prompt_logprobs: logprobs.LogprobsTensors | None = None  # of prompt_logprob_at, in order


def fill_rows(table: np.ndarray, rows: list[list[int]]) -> None:
    """table[i, :len(rows[i])] = rows[i] for every i, in a few numpy calls instead of one per row."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=table.dtype, count=int(lens.sum()))
    table[: len(rows)][np.arange(table.shape[1]) < lens[:, None]] = flat


@dataclass
class PluginClasses:
    """The engine's resolved plugin classes (resolved once, by name, at start-up)."""

    model: Any
    prefill_attention: Any
    decode_attention: Any
    kv_cache: Any
    adapters: list[Any]


class ModelRunner(Worker):
    def __init__(self, config: EngineConfig, plugins: PluginClasses, group: ProcessGroup,
                 device: torch.device, dtype: torch.dtype):
        self.config, self.group, self.device, self.dtype = config, group, device, dtype
        self.hf_config = load_hf_config(config.model)
        self.facts = ModelFacts.from_hf_config(self.hf_config)
        self.block_size = config.kv_block_size
        heads = self.facts.num_heads // group.world_size
        kv_heads = self.facts.num_kv_heads // group.world_size
        spec = AttentionSpec(heads, kv_heads, self.facts.head_dim, self.facts.head_dim ** -0.5,
                             self.block_size, dtype, device)
        decode = plugins.decode_attention(spec)
        prefill = decode if plugins.prefill_attention is plugins.decode_attention else plugins.prefill_attention(spec)
        self.ctx = StepContext(store=plugins.kv_cache(), prefill=prefill, decode=decode)

        def attention_factory(layer_idx, num_heads, num_kv_heads, head_dim):
            return PagedAttention(self.ctx, layer_idx, num_heads, num_kv_heads, head_dim)

        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = plugins.model(self.hf_config, group.layers(), attention_factory, config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        adapters = [cls(spec_, self.facts, self.hf_config) for cls, spec_ in plugins.adapters]
        load_weights(self.model, config.model, adapters)
        per_request = [a for a in adapters if not a.spec.merge]  # ids 1..K in config order, as the engine numbers them
        self.request_adapters = type(per_request[0]).serve_per_request(
            self.model, per_request, group, max(config.max_num_batched_tokens, config.max_num_seqs)
        ) if per_request else None
        self.model.eval()
        kernels = cpu_kernels.usable(config.cpu_kernels, dtype, device)  # float32 CPU steps' C++ kernels
        # packed after the LoRA merges, which change the weights
        pack_linear_weights(self.model, config.cpu_weight_packing, dtype, device, kernels)
        if kernels is not None:
            cpu_kernels.install(self.model, kernels)
        self.sampler = Sampler(device, config.seed, greedy=kernels.argmax if kernels is not None else None)
        self.pending: deque = deque()  # launched steps whose tokens are not collected yet
        self.last_tokens: torch.Tensor | None = None
        self.num_blocks = self._allocate_kv_cache()
        self.graphs: dict[int, Any] = {}
        if device.type == "cuda" and not config.enforce_eager and config.compile_fused_ops \
                and hasattr(self.model, "compile_fused_ops"):
            self.model.compile_fused_ops()
        if device.type == "cuda":
            self._warm_up()
        if device.type == "cuda" and not config.enforce_eager:
            graphs_ok = decode.supports_cuda_graphs and self.request_adapters is None  # per-request LoRA: eager
            if graphs_ok:
                self._capture_graphs()

    # ---------------------------------------------------------------------------- KV cache
    def _block_bytes(self) -> int:
        k = self.ctx.decode.spec
        return 2 * self.facts.num_layers * self.block_size * k.num_kv_heads * k.head_dim * self.dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        """Size the cache (fixed, or from memory) and allocate it with one scratch block at the end."""
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._blocks_from_gpu_memory()
        else:
            num_blocks = int(self.config.cpu_kv_cache_gb * 2**30 // self._block_bytes())
            num_blocks = max(num_blocks, 1)
        if self.group.world_size > 1:  # every rank must hold the same blocks: the fewest any rank has room for
            num_blocks = int(self.group.all_gather(torch.tensor([num_blocks], device=self.device), dim=0).min())
        self._set_cache(num_blocks + 1)
        return num_blocks

    def _set_cache(self, num_blocks: int) -> None:
        spec = self.ctx.decode.spec
        # on CUDA zeros, not empty: kernels that load whole pages (FlashAttention-4 by TMA) read the unused
        # rows of a sequence's last page, and NaN garbage there would turn into NaN outputs (0 * NaN)
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        kv = alloc(2, self.facts.num_layers, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                         dtype=self.dtype, device=self.device)
        self.kv_cache = kv
        self.ctx.kv_caches = [(kv[0, i], kv[1, i]) for i in range(self.facts.num_layers)]

    def _blocks_from_gpu_memory(self) -> int:
        """Run the largest prefill once on a small temporary cache, then give the rest to the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len * self.config.max_num_seqs)
        seq_len = min(n, self.config.max_model_len)
        num_seqs = max(1, n // seq_len)
        per_seq = (seq_len + self.block_size - 1) // self.block_size
        self._set_cache(num_seqs * per_seq + 1)
        batch = StepBatch(
            is_prefill=True, input_ids=[0] * (num_seqs * seq_len), starts=[0] * num_seqs,
            query_lens=[seq_len] * num_seqs,
            block_tables=[list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)],
            sample_rows=list(range(num_seqs)),
            sampling=SamplingBatch([0.0] * num_seqs, [0] * num_seqs, [1.0] * num_seqs, [0.0] * num_seqs,
                                   [None] * num_seqs, [0] * num_seqs),
        )
        self.run(batch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del self.kv_cache
        self.ctx.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - used_elsewhere - peak
        num_blocks = int(budget // self._block_bytes())
        if num_blocks < 1:
            raise RuntimeError(
                "no GPU memory left for the KV cache; raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks

    def _warm_up(self) -> None:
        """Run each kind of step once on the first blocks: fresh prefills and prefill chunks over
        cached context, with short and long queries, and a decode. Kernels that compile on first use
        (FlashAttention-4 builds one per variant, seconds each, and a query longer than one tile is
        another variant) then compile here, not inside the first requests' steps. The blocks are
        cleared before the block manager first hands them out (`take_new_blocks`)."""
        cfg, bs = self.config, self.block_size
        long = max(2, min(512, cfg.max_model_len - 2, cfg.max_num_batched_tokens))
        table = [min(i, self.num_blocks) for i in range((long + 1 + bs - 1) // bs)]
        greedy = SamplingBatch([0.0], [0], [1.0], [0.0], [None], [0])
        for is_prefill, start, n in ((True, 0, 2), (True, 0, long), (True, 1, 2), (True, 1, long), (False, 1, 1)):
            self.run(StepBatch(is_prefill=is_prefill, input_ids=[0] * n, starts=[start], query_lens=[n],
                               block_tables=[table], sample_rows=[0], sampling=greedy))
        torch.cuda.synchronize(self.device)

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    # --------------------------------------------------------------------------------- inputs
    def _prepare(self, batch: StepBatch):
        bs = self.block_size
        q_lens = np.asarray(batch.query_lens, dtype=np.int64)
        starts = np.asarray(batch.starts, dtype=np.int64)
        seq_lens = starts + q_lens
        seq_idx = np.repeat(np.arange(len(q_lens)), q_lens)
        cu_q = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        positions = np.arange(int(cu_q[-1])) - np.repeat(cu_q[:-1], q_lens) + np.repeat(starts, q_lens)
        width = max(len(t) for t in batch.block_tables)
        tables = np.full((len(q_lens), width), -1, dtype=np.int64)
        fill_rows(tables, batch.block_tables)
        slots = tables[seq_idx, positions // bs] * bs + positions % bs
        cu_k = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=cu_k[1:])
        dev = self.device

        def put(a, dtype):
            return to_device(np.ascontiguousarray(a), dtype, dev)

        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            cu_seqlens_q=put(cu_q, torch.int32),
            cu_seqlens_k=put(cu_k, torch.int32),
            seq_lens=put(seq_lens, torch.int32),
            slot_mapping=put(slots, torch.int64),
            block_tables=put(tables, torch.int32),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(seq_lens.max()),
            query_lens_host=q_lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )
        last = cu_q[1:][batch.sample_rows] - 1 if batch.sample_rows else np.zeros(0, dtype=np.int64)
        return put(np.asarray(batch.input_ids), torch.int64), put(positions, torch.int64), meta, put(last, torch.int64)

    # ----------------------------------------------------------------------------------- step
    def run(self, batch: StepBatch) -> StepResult | None:
        """Compute one step; rank 0 returns the sampled tokens, the requested logits rows and logprobs."""
        self.launch(batch)
        return self.collect()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> None:
        """Queue one step's device work (model, sampler, the copy of the tokens back) without waiting.

        The host may then prepare the next step while the device computes this one; `collect`
        waits for the tokens. At most one step may be uncollected when the next is launched (the
        graph inputs' pinned host buffers come in two, used in turn)."""
        num_seqs = len(batch.query_lens)
        if batch.new_blocks:  # never-written memory may hold NaN that padded reads would spread
            self.kv_cache.index_fill_(2, to_device(batch.new_blocks, torch.int64, self.device), 0)
        graph = None if batch.is_prefill else self._graph_for(num_seqs)
        if self.request_adapters is not None:
            ids = np.asarray(batch.adapter_ids or [0] * num_seqs, dtype=np.int64)
            self.request_adapters.set_step(torch.from_numpy(np.repeat(ids, batch.query_lens)))
        prompt_lps = None
        if graph is not None:
            logits = self._replay(graph, batch)
        else:
            input_ids, positions, meta, last = self._prepare(batch)
            if batch.from_previous_at:
                at = to_device(batch.from_previous_at, torch.int64, self.device)
                rows = to_device(batch.from_previous_rows, torch.int64, self.device)
                input_ids.index_copy_(0, at, self.last_tokens.index_select(0, rows))
            self.ctx.set_step(meta)
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden[last]) if batch.sample_rows else None
            prompt_lps = self._prompt_logprobs(hidden, batch) if batch.prompt_logprob_at else None
        if batch.block_copies:  # after the forward that wrote the blocks copied
            src, dst = zip(*batch.block_copies)
            dst = to_device(dst, torch.int64, self.device)
            self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, to_device(src, torch.int64, self.device)))
        if self.group.rank != 0 or not (batch.sample_rows or batch.prompt_logprob_at):
            self.pending.append(None)
            return
        if batch.sample_rows:
            tokens = self.sampler(logits, batch.sampling)
            self.last_tokens = tokens  # the next step may read its inputs from here
        else:  # a prompt chunk that only scores prompt tokens
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        # both read the logits before a replay overwrites them
        rows = logits[batch.logits_rows].float() if batch.logits_rows else None
        lps = self.sampler.logprobs(logits, tokens, batch.sampling) if batch.sampling.logprob_rows else None
        result = StepResult(tokens, rows, lps, prompt_lps)
        if self.device.type == "cuda":
            result = StepResult(tokens.to("cpu", non_blocking=True),
                                rows.to("cpu", non_blocking=True) if rows is not None else None,
                                *(lp.to_host(non_blocking=True) if lp is not None else None
                                  for lp in (result.logprobs, result.prompt_logprobs)))
            done = torch.cuda.Event()
            done.record()
        else:
            done = None
        self.pending.append((result, done))

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch) -> logprobs.LogprobsTensors | None:
        """Logprobs of the prompt tokens this step scores, a few hundred positions at a time (every rank
        computes the logits, since the LM head may gather them; rank 0 keeps the logprobs)."""
        at = to_device(batch.prompt_logprob_at, torch.int64, self.device)
        ids = to_device(batch.prompt_logprob_ids, torch.int64, self.device)
        parts = []
        for i in range(0, len(batch.prompt_logprob_at), logprobs.ROWS_PER_PASS):
            part = slice(i, i + logprobs.ROWS_PER_PASS)
            logits = self.model.compute_logits(hidden.index_select(0, at[part]))
            if self.group.rank == 0:
                parts.append(logprobs.compute(logits, ids[part], batch.prompt_logprob_top))
        return logprobs.LogprobsTensors.cat(parts) if parts else None

    def collect(self) -> StepResult | None:
        """Wait for the oldest launched step's result (rank 0; None on other ranks)."""
        entry = self.pending.popleft()
        if self.group.rank != 0:
            return None
        if entry is None:
            return StepResult([])
        result, done = entry
        if done is not None:
            done.synchronize()
        result.tokens = result.tokens.tolist()
        result.logits = list(result.logits) if result.logits is not None else []
        return result

    # ------------------------------------------------------------------------------- graphs
    def _graph_for(self, num_seqs: int):
        if not self.graphs:
            return None
        for size in self.graphs:
            if size >= num_seqs:
                return self.graphs[size]
        return None

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture decode for batch-size buckets; a replay pads the batch up to the next bucket.

        A backend whose kernels cannot be captured leaves decode eager (logged), never broken."""
        try:
            self._capture_graph_buckets()
        except Exception as exc:  # noqa: BLE001  (any capture failure means: run eager)
            log.warning("CUDA graph capture failed (%s: %s); decode runs eager", type(exc).__name__, exc)
            self.graphs = {}
            torch.cuda.synchronize(self.device)

    def _capture_graph_buckets(self) -> None:
        max_bs = min(self.config.max_num_seqs, GRAPH_BATCH_SIZES[-1])
        sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_bs]
        max_blocks = (self.config.max_model_len + self.block_size - 1) // self.block_size
        dev = self.device
        # the graphs' inputs live in two device buffers fed from pinned host buffers: a replay costs
        # two host-to-device copies, with no allocation. Two sets of host buffers, used in turn: the
        # host fills one while the copy of the last step may still be reading the other
        self._hosts = [(torch.zeros(5, max_bs, dtype=torch.int64).pin_memory(),
                        torch.zeros(2 * max_bs + 1 + max_bs * max_blocks, dtype=torch.int32).pin_memory())
                       for _ in range(2)]
        self._dev64, self._dev32 = (t.to(dev) for t in self._hosts[0])
        d32 = self._dev32
        st = {
            "input_ids": self._dev64[0], "positions": self._dev64[1], "slot_mapping": self._dev64[2],
            "seq_lens": d32[:max_bs], "cu_seqlens_k": d32[max_bs:2 * max_bs + 1],
            "block_tables": d32[2 * max_bs + 1:].view(max_bs, max_blocks),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        st["slot_mapping"].fill_(self.scratch_slot)
        st["seq_lens"].fill_(1)
        st["cu_seqlens_k"].copy_(st["cu_seqlens_q"])
        st["block_tables"].fill_(self.num_blocks)
        self.static = st
        pool = None
        for size in reversed(sizes):
            meta = AttentionMetadata(
                is_prefill=False, cu_seqlens_q=st["cu_seqlens_q"][: size + 1], cu_seqlens_k=st["cu_seqlens_k"][: size + 1],
                seq_lens=st["seq_lens"][:size], slot_mapping=st["slot_mapping"][:size],
                block_tables=st["block_tables"][:size], max_seqlen_q=1, max_seqlen_k=self.config.max_model_len,
                query_lens_host=[1] * size, seq_lens_host=[1] * size,
            )
            self.ctx.set_step(meta)
            ids, pos = st["input_ids"][:size], st["positions"][:size]
            self.model.compute_logits(self.model(ids, pos))  # warm up outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                logits = self.model.compute_logits(self.model(ids, pos))
            pool = graph.pool()
            self.graphs[size] = (graph, meta, logits)
            torch.cuda.synchronize(dev)
        self.graphs = dict(sorted(self.graphs.items()))

    def _replay(self, entry, batch: StepBatch) -> torch.Tensor:
        graph, meta, logits = entry
        n, size = len(batch.query_lens), meta.seq_lens.shape[0]
        self._hosts.reverse()
        host64, host32 = self._hosts[0]
        bs, max_bs = self.block_size, host64.shape[1]
        starts = np.asarray(batch.starts, dtype=np.int64)
        h64, h32 = host64.numpy(), host32.numpy()
        seq_lens, cu_k = h32[:max_bs], h32[max_bs:2 * max_bs + 1]
        tables = h32[2 * max_bs + 1:].reshape(max_bs, -1)
        tables[:size] = self.num_blocks  # padding rows and columns point at the scratch block
        fill_rows(tables, batch.block_tables)
        h64[0, :n], h64[0, n:size] = batch.input_ids, 0
        h64[1, :n], h64[1, n:size] = starts, 0
        h64[2, :n] = tables[np.arange(n), starts // bs].astype(np.int64) * bs + starts % bs
        h64[2, n:size] = self.scratch_slot
        seq_lens[:n], seq_lens[n:size] = starts + 1, 1
        np.cumsum(seq_lens[:size], out=cu_k[1:size + 1])
        k = len(batch.from_previous_at)
        h64[3, :k], h64[4, :k] = batch.from_previous_at, batch.from_previous_rows
        self._dev64.copy_(host64, non_blocking=True)
        self._dev32.copy_(host32, non_blocking=True)
        if k:
            d64 = self._dev64
            d64[0].index_copy_(0, d64[3, :k], self.last_tokens.index_select(0, d64[4, :k]))
        meta.query_lens_host, meta.seq_lens_host = [1] * size, seq_lens[:size].tolist()
        meta.max_seqlen_k = int(seq_lens[:size].max())
        self.ctx.meta = meta
        self.ctx.decode.prepare(meta)
        graph.replay()
        return logits[: n][batch.sample_rows] if len(batch.sample_rows) != n else logits[:n]

    def kv_blocks(self) -> int:
        return self.num_blocks

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self, method)(*args)
