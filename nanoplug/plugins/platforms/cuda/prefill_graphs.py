"""Fresh prefill steps captured as CUDA graphs for token-count buckets.

A small prefill launches a few hundred kernels whose host-side cost (Python, compiled-region guards,
FlashAttention-4's call path) is many times their GPU time, and that is most of a request's time to
first token and of every admission into a running batch. Captured, it is one launch. A replay pads
the step's tokens up to the bucket with one padding sequence (see `plan_fresh_prefill`), the graph
computes the logits of each sequence's last token only, and its inputs come through pinned host
buffers used in turn, as the decode graphs' do. Steps with cached context, more sequences or more
tokens than the largest bucket run eager.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from nanoplug.api import AttentionMetadata, PrefillGraphs, StepInputs, StepLimits
from nanoplug.plugins.platforms.cuda.graphs import capture

PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PREFILL_GRAPH_SEQS = 8


class CudaPrefillGraphs(PrefillGraphs):
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], ctx: Any,
                 limits: StepLimits, scratch_block: int, device: torch.device):
        self.forward, self.ctx, self.device = forward, ctx, device
        self.scratch_block, self.block_size = scratch_block, limits.block_size
        self.sizes = tuple(s for s in PREFILL_GRAPH_TOKENS if s <= limits.max_num_batched_tokens)
        self.max_seqs = min(limits.max_num_seqs, PREFILL_GRAPH_SEQS)
        self.graphs: dict[int, Any] = {}

    @torch.inference_mode()
    def capture(self, pool: Any) -> Any:
        """Capture every bucket, largest first, into `pool` (the decode graphs'); returns the pool."""
        tokens, seqs = self.sizes[-1], self.max_seqs
        # int64: ids, positions, slots [tokens each], last rows [seqs]; int32: cu_q, cu_k [seqs + 2], lens [seqs + 1]
        self._hosts = [(torch.zeros(3 * tokens + seqs, dtype=torch.int64).pin_memory(),
                        torch.zeros(3 * seqs + 5, dtype=torch.int32).pin_memory()) for _ in range(2)]
        self._dev64, self._dev32 = (t.to(self.device) for t in self._hosts[0])
        ids, pos, slots, rows = self._split64(self._dev64)
        cu_q, cu_k, lens = self._split32(self._dev32)
        slots.fill_(self.scratch_block * self.block_size)
        table = torch.full((seqs + 1, 1), self.scratch_block, dtype=torch.int32, device=self.device)
        for size in reversed(self.sizes):
            cu_q[1:].fill_(size)  # one sequence of `size` tokens, then empty ones
            cu_k.copy_(cu_q)
            lens.zero_()
            lens[0] = size
            host_lens = [size] + [0] * seqs
            meta = AttentionMetadata(
                is_prefill=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_lens=lens, slot_mapping=slots[:size],
                block_tables=table, max_seqlen_q=size, max_seqlen_k=size, query_lens_host=host_lens,
                seq_lens_host=list(host_lens),
            )
            self.ctx.set_step(meta)
            graph, logits, pool = capture(lambda: self.forward(ids[:size], pos[:size], rows), pool, self.device)
            self.graphs[size] = (graph, meta, logits)
        self.graphs = dict(sorted(self.graphs.items()))
        return pool

    def _split64(self, t: torch.Tensor):
        n = self.sizes[-1]
        return t[:n], t[n:2 * n], t[2 * n:3 * n], t[3 * n:]

    def _split32(self, t: torch.Tensor):
        s = self.max_seqs
        return t[:s + 2], t[s + 2:2 * s + 4], t[2 * s + 4:]

    def inputs(self, size: int) -> StepInputs:
        self._hosts.reverse()
        host64, host32 = (t.numpy() for t in self._hosts[0])
        ids, pos, slots, rows = self._split64(host64)
        cu_q, cu_k, lens = self._split32(host32)
        return StepInputs(input_ids=ids, positions=pos, slot_mapping=slots, seq_lens=lens, cu_seqlens_q=cu_q,
                          cu_seqlens_k=cu_k, block_tables=None, from_previous_at=None, from_previous_rows=None,
                          last_rows=rows)

    def replay(self, size: int, inputs: StepInputs) -> torch.Tensor:
        graph, meta, logits = self.graphs[size]
        host64, host32 = self._hosts[0]
        self._dev64.copy_(host64, non_blocking=True)
        self._dev32.copy_(host32, non_blocking=True)
        meta.query_lens_host, meta.seq_lens_host = inputs.query_lens_host, inputs.seq_lens_host
        self.ctx.set_step(meta)
        graph.replay()
        return logits
