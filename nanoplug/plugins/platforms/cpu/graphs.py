"""Decode steps recorded once per batch size and replayed: the CPU's counterpart of CUDA graphs.

A decode step of a small model on a CPU spends about as long in Python (module calls, argument checks,
allocations) as in its kernels. A recording runs the model once on static input buffers and keeps, in
order, every call that computes something: the C kernels' calls (`kernels/record.py`) and the torch ops
(seen by a dispatch mode), with the addresses and tensors they used. Every tensor made while recording
stays alive, so a replay is just those calls again, reading the static inputs the engine planned into.
Views and allocations are not calls. An op whose result depends on the data in Python (`.item()`,
`nonzero`) cannot be replayed: the capture fails and decode runs eager, with a warning (or start-up
stops, with `cpu.require_graphs`).

Each recording is checked before it is used: other token ids go through the model eagerly and through
the replay (with an eager step on yet other ids between them), and the logits must be equal, so a call
the recording could not see (another library's ctypes call, Triton's CPU interpreter writing the KV
cache through numpy) shows up before it is used rather than as wrong tokens.

A size is recorded when a decode step first needs it (`lazy`, the default on one rank: a command that
generates one answer records one size, a few tenths of a second, instead of every size before its first
token), or every size at start-up (`cpu.record_ahead`, and always under tensor parallelism, where each
rank must record in step). A lazy recording that fails leaves that size eager, with a warning.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanoplug.api import AttentionMetadata, StepGraphs, StepInputs, StepLimits
from nanoplug.kernels.cpu.record import set_plan

log = logging.getLogger("nanoplug")
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # larger batches pay little Python per token
aten = torch.ops.aten
_ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
_DATA_DEPENDENT = {aten._local_scalar_dense, aten.item, aten.nonzero, aten.masked_select, aten.unique_dim,
                   aten._unique2, aten.unique_consecutive, aten.repeat_interleave}


class CaptureError(RuntimeError):
    """A decode step that cannot be replayed from a recording."""


class _Refresh:
    """A functional op replayed: computed again and copied into the tensor(s) it gave when recorded."""

    __slots__ = ("func", "args", "kwargs", "out")

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out

    def __call__(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(result)
        else:
            for dst, src in zip(self.out, result):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """torch wraps a mode's __torch_dispatch__ so that Dynamo never traces it, and that wrapper imports
        torch._dynamo at the first call: half a second of the first decode step (the second token) on a CPU.
        No recording runs under Dynamo, so the wrapper is not wanted (torch's own docstring shows this opt-out)."""
        return False

    def __init__(self, plan: list[Callable[[], Any]], keep: list[Any]):
        super().__init__()
        self.plan, self.keep = plan, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _DATA_DEPENDENT:
            raise CaptureError(f"the decode step calls {func}, whose result depends on the data")
        out = func(*args, **kwargs)
        self.keep.append(out)  # recorded calls hold its address
        if func.overloadpacket in _ALLOCATIONS or (func.is_view and _aliases(out, args)):
            return out  # (`to` is a view only when it converts nothing)
        if func.namespace == "c10d":  # a collective (tensor parallelism): again, and waited on as when recorded
            self.plan.append(lambda f=func, a=args, k=kwargs: _wait(f(*a, **k)))
        elif func._schema.is_mutable:  # in place or out=: the same call again
            self.plan.append(lambda f=func, a=args, k=kwargs: f(*a, **k))
        else:
            self.plan.append(_Refresh(func, args, kwargs, out))
        return out


def _wait(result: Any) -> None:
    """Wait for the work a replayed collective returns (gloo runs it on its own threads)."""
    for item in result if isinstance(result, (list, tuple)) else (result,):
        if hasattr(item, "wait"):
            item.wait()


def _storages(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [x.untyped_storage().data_ptr()]
    if isinstance(x, (list, tuple)):
        return [p for item in x for p in _storages(item)]
    return []


def _aliases(out: Any, args: tuple) -> bool:
    """Every tensor `out` holds lives in the storage of an argument (a view, not a computed tensor)."""
    inputs = set(_storages(args))
    outs = _storages(out)
    return bool(outs) and all(p in inputs for p in outs)


def record(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ids: torch.Tensor,
           positions: torch.Tensor) -> tuple[list[Callable[[], Any]], list[Any], torch.Tensor]:
    """Run `forward` once, recording it: (the calls, the tensors to keep alive, the logits it wrote)."""
    plan: list[Callable[[], Any]] = []
    keep: list[Any] = []
    set_plan(plan)
    try:
        with _Recorder(plan, keep):
            logits = forward(ids, positions)
    finally:
        set_plan(None)
    return plan, keep, logits


class CpuDecodeGraphs(StepGraphs):
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ctx: Any, limits: StepLimits,
                 scratch_block: int, lazy: bool = False):
        self.forward, self.ctx, self.limits, self.scratch_block = forward, ctx, limits, scratch_block
        self.lazy = lazy
        self.graphs: dict[int, tuple[list[Callable[[], Any]], list[Any], AttentionMetadata, torch.Tensor]] = {}
        self.failed: dict[int, str] = {}  # lazily recorded sizes that could not be: they run eager

    def size_for(self, num_seqs: int) -> int | None:
        return next((size for size in self.sizes if size >= num_seqs), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Set up the static inputs; record and check a decode step for each batch size up to max_num_seqs
        now, or (lazy) each when first needed."""
        limits = self.limits
        max_bs = min(limits.decode_rows, GRAPH_BATCH_SIZES[-1])
        max_blocks = (limits.max_model_len + limits.block_size - 1) // limits.block_size
        self.max_bs = max_bs
        self.sizes = tuple(s for s in GRAPH_BATCH_SIZES if s <= max_bs)
        i64 = torch.zeros(5, max_bs, dtype=torch.int64)
        i32 = torch.zeros(2 * max_bs + 1 + max_bs * max_blocks, dtype=torch.int32)
        self._buffers = (i64, i32)
        st = {
            "input_ids": i64[0], "positions": i64[1], "slot_mapping": i64[2],
            "seq_lens": i32[:max_bs], "cu_seqlens_k": i32[max_bs:2 * max_bs + 1],
            "block_tables": i32[2 * max_bs + 1:].view(max_bs, max_blocks),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32),
        }
        self.static = st
        self._cu_q_host = st["cu_seqlens_q"].numpy()
        if not self.lazy:
            for size in self.sizes:
                self._record(size)

    def _record(self, size: int) -> None:
        """Record the decode step of `size` rows on the static inputs (padding rows) and check its replay."""
        st = self.static
        self._reset()
        meta = self._meta(size, self.limits.max_model_len, [1] * size, [1] * size)
        ids, pos = st["input_ids"][:size], st["positions"][:size]
        self.ctx.set_step(meta)
        plan, keep, logits = record(self.forward, ids, pos)
        self.graphs[size] = (plan, keep, meta, logits)
        self.captures += 1
        try:
            self._check(size, logits.shape[-1])
        except CaptureError:
            del self.graphs[size]
            raise

    def _record_now(self, size: int) -> None:
        """Record `size` in the middle of serving: the inputs already planned into the static buffers are
        kept aside meanwhile (the recording writes padding rows there and only to the scratch block)."""
        saved = [b.clone() for b in self._buffers]
        try:
            self._record(size)
            log.info("cpu: decode steps of %d rows recorded", size)
        except CaptureError as exc:
            self.failed[size] = str(exc)
            log.warning("cpu: decode steps of %d rows run eager: %s", size, exc)
        finally:
            for buffer, copy in zip(self._buffers, saved):
                buffer.copy_(copy)

    def _reset(self) -> None:
        """Every row padding: position 0, writing to the scratch block, context length 1."""
        st, block = self.static, self.limits.block_size
        st["input_ids"].zero_()
        st["positions"].zero_()
        st["slot_mapping"].fill_(self.scratch_block * block)
        st["seq_lens"].fill_(1)
        st["cu_seqlens_k"].copy_(st["cu_seqlens_q"])
        st["block_tables"].fill_(self.scratch_block)

    def _check(self, size: int, vocab: int) -> None:
        """Other token ids, eagerly and replayed: equal logits, or the recording missed a call. An eager
        step on yet other ids runs in between, so a missed write (the KV store, say) leaves the replay
        reading that step's values, not the ones it should have written itself."""
        plan, keep, meta, logits = self.graphs[size]
        ids, positions = self.static["input_ids"][:size], self.static["positions"][:size]
        self.ctx.set_step(meta)
        ids.copy_(torch.arange(1, size + 1) * 7919 % vocab)
        eager = self.forward(ids, positions).clone()
        ids.copy_(torch.arange(1, size + 1) * 104729 % vocab)
        self.forward(ids, positions)
        ids.copy_(torch.arange(1, size + 1) * 7919 % vocab)
        for call in plan:
            call()
        if not torch.equal(eager, logits):
            diff = (eager - logits).abs().max().item()
            raise CaptureError(f"the replayed decode step of {size} rows differs from the eager one (max |diff| "
                               f"{diff:.3g}): the model calls something the recording does not see")

    def inputs(self, size: int) -> StepInputs:
        i64, i32 = (t.numpy() for t in self._buffers)
        max_bs = self.max_bs
        return StepInputs(
            input_ids=i64[0], positions=i64[1], slot_mapping=i64[2], from_previous_at=i64[3],
            from_previous_rows=i64[4], seq_lens=i32[:max_bs], cu_seqlens_k=i32[max_bs:2 * max_bs + 1],
            block_tables=i32[2 * max_bs + 1:].reshape(max_bs, -1), cu_seqlens_q=self._cu_q_host,
        )

    def replay(self, size: int, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> torch.Tensor:
        graph = self.graphs.get(size)
        if graph is None and size not in self.failed:
            self._record_now(size)
            graph = self.graphs.get(size)
        k = inputs.num_from_previous
        if k:
            i64 = self._buffers[0]
            i64[0].index_copy_(0, i64[3, :k], previous_tokens.index_select(0, i64[4, :k]))
        if graph is None:  # its recording failed: the same step, eager, on the same buffers
            return self._eager(size, inputs)
        plan, _, meta, logits = graph
        meta.query_lens_host, meta.seq_lens_host = inputs.query_lens_host, inputs.seq_lens_host
        meta.max_seqlen_k = inputs.max_seqlen_k
        self.ctx.set_step(meta)
        for call in plan:
            call()
        return logits

    def _eager(self, size: int, inputs: StepInputs) -> torch.Tensor:
        st = self.static
        self.ctx.set_step(self._meta(size, inputs.max_seqlen_k, inputs.query_lens_host, inputs.seq_lens_host))
        return self.forward(st["input_ids"][:size], st["positions"][:size])

    def _meta(self, size: int, max_seqlen_k: int, query_lens_host: list[int], seq_lens_host: list[int]):
        """The decode metadata of `size` rows over the static inputs."""
        st = self.static
        return AttentionMetadata(
            is_prefill=False, cu_seqlens_q=st["cu_seqlens_q"][: size + 1],
            cu_seqlens_k=st["cu_seqlens_k"][: size + 1], seq_lens=st["seq_lens"][:size],
            slot_mapping=st["slot_mapping"][:size], block_tables=st["block_tables"][:size], max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k, query_lens_host=query_lens_host, seq_lens_host=seq_lens_host,
        )
