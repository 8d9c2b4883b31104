"""Decode steps captured as CUDA graphs for batch-size buckets; a replay pads the batch up to the next bucket.

The graphs' inputs live in two device buffers fed from pinned host buffers: a replay costs two
host-to-device copies, with no allocation. Two sets of host buffers are used in turn: the host plans
into one while the copy of the last step may still be reading the other. The engine plans a step's
inputs into `inputs(size)` exactly as it plans an eager step's (nanoplug/worker/inputs.py): rows past
the batch are padding that writes to the scratch block.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from nanoplug.api import AttentionMetadata, StepGraphs, StepInputs, StepLimits

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture(run: Callable[[], torch.Tensor], pool: Any, device: torch.device) -> tuple[Any, torch.Tensor, Any]:
    """`run` once outside a graph (kernels that set up or compile on first use do it there), then captured into
    `pool` (graphs captured in turn share one pool: one step runs at a time): (graph, its output, the pool)."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        out = run()
    torch.cuda.synchronize(device)
    return graph, out, graph.pool()


class DecodeGraphs(StepGraphs):
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ctx: Any, limits: StepLimits,
                 scratch_block: int, device: torch.device):
        self.forward, self.ctx, self.limits, self.device = forward, ctx, limits, device
        self.scratch_block = scratch_block
        self.graphs: dict[int, Any] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        limits, dev = self.limits, self.device
        max_bs = min(limits.decode_rows, GRAPH_BATCH_SIZES[-1])
        sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_bs]
        max_blocks = (limits.max_model_len + limits.block_size - 1) // limits.block_size
        self.max_bs = max_bs
        self._hosts = [(torch.zeros(5, max_bs, dtype=torch.int64).pin_memory(),
                        torch.zeros(2 * max_bs + 1 + max_bs * max_blocks, dtype=torch.int32).pin_memory())
                       for _ in range(2)]
        self._cu_q_host = np.arange(max_bs + 1, dtype=np.int32)  # static on the device: never copied
        self._dev64, self._dev32 = (t.to(dev) for t in self._hosts[0])
        d32 = self._dev32
        st = {
            "input_ids": self._dev64[0], "positions": self._dev64[1], "slot_mapping": self._dev64[2],
            "seq_lens": d32[:max_bs], "cu_seqlens_k": d32[max_bs:2 * max_bs + 1],
            "block_tables": d32[2 * max_bs + 1:].view(max_bs, max_blocks),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        st["slot_mapping"].fill_(self.scratch_block * limits.block_size)
        st["seq_lens"].fill_(1)
        st["cu_seqlens_k"].copy_(st["cu_seqlens_q"])
        st["block_tables"].fill_(self.scratch_block)
        self.static = st
        pool = None
        for size in reversed(sizes):
            meta = AttentionMetadata(
                is_prefill=False, cu_seqlens_q=st["cu_seqlens_q"][: size + 1], cu_seqlens_k=st["cu_seqlens_k"][: size + 1],
                seq_lens=st["seq_lens"][:size], slot_mapping=st["slot_mapping"][:size],
                block_tables=st["block_tables"][:size], max_seqlen_q=1, max_seqlen_k=limits.max_model_len,
                query_lens_host=[1] * size, seq_lens_host=[1] * size,
            )
            self.ctx.set_step(meta)
            ids, pos = st["input_ids"][:size], st["positions"][:size]
            graph, logits, pool = capture(lambda: self.forward(ids, pos), pool, dev)
            self.graphs[size] = (graph, meta, logits)
            self.captures += 1
        self.graphs = dict(sorted(self.graphs.items()))
        self.pool = pool  # prefill graphs capture into it too (one step runs at a time)

    def inputs(self, size: int) -> StepInputs:
        self._hosts.reverse()
        host64, host32 = self._hosts[0]
        h64, h32 = host64.numpy(), host32.numpy()
        max_bs = self.max_bs
        return StepInputs(
            input_ids=h64[0], positions=h64[1], slot_mapping=h64[2], from_previous_at=h64[3],
            from_previous_rows=h64[4], seq_lens=h32[:max_bs], cu_seqlens_k=h32[max_bs:2 * max_bs + 1],
            block_tables=h32[2 * max_bs + 1:].reshape(max_bs, -1), cu_seqlens_q=self._cu_q_host,
        )

    def replay(self, size: int, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> torch.Tensor:
        graph, meta, logits = self.graphs[size]
        host64, host32 = self._hosts[0]
        self._dev64.copy_(host64, non_blocking=True)
        self._dev32.copy_(host32, non_blocking=True)
        k = inputs.num_from_previous
        if k:
            d64 = self._dev64
            d64[0].index_copy_(0, d64[3, :k], previous_tokens.index_select(0, d64[4, :k]))
        meta.query_lens_host, meta.seq_lens_host = inputs.query_lens_host, inputs.seq_lens_host
        meta.max_seqlen_k = inputs.max_seqlen_k
        self.ctx.set_step(meta)
        graph.replay()
        return logits
