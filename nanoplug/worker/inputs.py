"""A step's inputs planned on the host, in one place for eager steps and graph replays alike.

From the scheduled batch (token ids, how far each sequence is, its block table) come every token's
position and cache slot, the context lengths, the cumulative offsets and the padded block tables
(padding: the scratch block past the blocks the engine hands out, see nanoplug/api/step.py). An eager
step plans into fresh arrays of its own size; a graph replay plans into the graph's pinned host
buffers, padded up to the captured batch size (decode) or token count (a fresh prefill).
"""
from __future__ import annotations

import itertools

import numpy as np

from nanoplug.api import StepBatch, StepInputs


def fill_rows(table: np.ndarray, rows: list[list[int]]) -> None:
    """table[i, :len(rows[i])] = rows[i] for every i, in a few numpy calls instead of one per row."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=table.dtype, count=int(lens.sum()))
    table[: len(rows)][np.arange(table.shape[1]) < lens[:, None]] = flat


def padded_tables(batch: StepBatch, scratch_block: int, rows: list[list[int]] | None = None) -> np.ndarray:
    """The batch's block tables (or `rows`, one KV group's) as one int32 array, each row padded with the scratch block."""
    rows = batch.block_tables if rows is None else rows
    tables = np.full((len(rows), max(len(t) for t in rows)), scratch_block, dtype=np.int32)
    fill_rows(tables, rows)
    return tables


def token_slots(tables: np.ndarray, q_lens: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of every token: its sequence's block for its position, and the row within it."""
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    return tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


def plan_inputs(batch: StepBatch, block_size: int, scratch_block: int, out: StepInputs | None = None,
                rows: int | None = None) -> StepInputs:
    """The inputs of `batch`. With `out` (a graph's host buffers, one token per sequence), they are
    written there for `rows` sequences, the batch's followed by padding; else into new arrays."""
    bs = block_size
    q_lens = np.asarray(batch.query_lens, dtype=np.int64)
    starts = np.asarray(batch.starts, dtype=np.int64)
    n = len(q_lens)
    cu_q = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    num_tokens = int(cu_q[-1])
    positions = np.arange(num_tokens) - np.repeat(cu_q[:-1], q_lens) + np.repeat(starts, q_lens)
    seq_lens = starts + q_lens
    k = len(batch.from_previous_at)
    if out is None:
        tables = padded_tables(batch, scratch_block)
        slots = token_slots(tables, q_lens, positions, bs)
        cu_k = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=cu_k[1:])
        inputs = StepInputs(
            input_ids=np.asarray(batch.input_ids, dtype=np.int64), positions=positions, slot_mapping=slots,
            seq_lens=seq_lens.astype(np.int32), cu_seqlens_q=cu_q.astype(np.int32), cu_seqlens_k=cu_k,
            block_tables=tables, from_previous_at=np.asarray(batch.from_previous_at, dtype=np.int64),
            from_previous_rows=np.asarray(batch.from_previous_rows, dtype=np.int64), num_from_previous=k,
            query_lens_host=q_lens.tolist(), seq_lens_host=seq_lens.tolist(),
            max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(seq_lens.max()),
        )
        for group in batch.group_block_tables:  # a hybrid model's KV groups 1..: their own tables and slots
            inputs.group_block_tables.append(padded_tables(batch, scratch_block, group))
            inputs.group_slot_mappings.append(token_slots(inputs.group_block_tables[-1], q_lens, positions, bs))
        return inputs
    if batch.group_block_tables:
        raise ValueError("a model with KV groups (mixed windows) runs eager steps only")
    if num_tokens != n or rows is None or rows < n:
        raise ValueError("graph inputs hold one token per sequence and room for every sequence of the step")
    tables = out.block_tables
    tables[:rows] = scratch_block  # padding rows and columns point at the scratch block
    fill_rows(tables, batch.block_tables)
    out.input_ids[:n], out.input_ids[n:rows] = batch.input_ids, 0
    out.positions[:n], out.positions[n:rows] = positions, 0
    out.slot_mapping[:n] = token_slots(tables, q_lens, positions, bs)
    out.slot_mapping[n:rows] = scratch_block * bs
    out.seq_lens[:n], out.seq_lens[n:rows] = seq_lens, 1
    np.cumsum(out.seq_lens[:rows], out=out.cu_seqlens_k[1:rows + 1])
    out.cu_seqlens_k[0] = 0
    out.from_previous_at[:k], out.from_previous_rows[:k] = batch.from_previous_at, batch.from_previous_rows
    out.num_from_previous = k
    out.query_lens_host = [1] * rows
    out.seq_lens_host = out.seq_lens[:rows].tolist()
    out.max_seqlen_q = 1
    out.max_seqlen_k = max(out.seq_lens_host)
    return out


def plan_fresh_prefill(batch: StepBatch, block_size: int, scratch_block: int, out: StepInputs,
                       size: int) -> StepInputs:
    """The inputs of a prefill step whose sequences all start at position 0, into a captured prefill's host
    buffers (`out`, room for `len(out.last_rows)` sequences): `size` tokens, the batch's followed by one
    padding sequence of token 0 at position 0 writing to the scratch block, which takes the tokens left
    (so every token belongs to a sequence and computes finite values); sequences after it are empty."""
    bs = block_size
    q_lens = np.asarray(batch.query_lens, dtype=np.int64)
    n, total, seqs = len(q_lens), int(q_lens.sum()), len(out.last_rows)
    if any(batch.starts) or total > size or n > seqs:
        raise ValueError(f"a captured prefill of {size} tokens takes up to {seqs} sequences that start at 0; got "
                         f"{n} sequences of {total} tokens, starting at {batch.starts}")
    cu = np.zeros(seqs + 2, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:n + 1])
    cu[n + 1:] = size
    positions = np.arange(total) - np.repeat(cu[:n], q_lens)
    out.input_ids[:total], out.input_ids[total:size] = batch.input_ids, 0
    out.positions[:total], out.positions[total:size] = positions, 0
    out.slot_mapping[:total] = token_slots(padded_tables(batch, scratch_block), q_lens, positions, bs)
    out.slot_mapping[total:size] = scratch_block * bs
    lens = np.diff(cu)
    out.cu_seqlens_q[:], out.cu_seqlens_k[:], out.seq_lens[:] = cu, cu, lens
    out.last_rows[:n], out.last_rows[n:] = cu[1:n + 1] - 1, 0
    out.num_from_previous = 0
    out.query_lens_host = out.seq_lens_host = lens.tolist()
    out.max_seqlen_q = out.max_seqlen_k = size
    return out
