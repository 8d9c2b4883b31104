"""The live K/V of a group of sequences copied out of the paged cache into one packed buffer, laid out by
the step's cumulative context lengths: what a varlen attention kernel without page tables reads (torch
2.11's `varlen_attn`, PyTorch's FlashAttention).

One Triton program per (sequence, chunk of positions) reads the sequence's length, offset and block table
on the device, and a chunk past its sequence's end copies nothing. So no value is read on the host and
the grid depends only on the group's size and the longest context the step may have (the model's limit
in a captured graph): a CUDA graph replays it on new inputs. The program of a sequence's first chunk also
writes the group's query and key offsets, counted from the group's first sequence, for the attention
call that follows. The kernel takes the step's whole tensors and the group's first sequence, which is not
specialized on, nor are the group's size and the block tables' width: pointers and integers that vary
from step to step would otherwise compile new variants while requests run.
"""
from __future__ import annotations

import torch

from nanoplug.api import import_triton

# where triton is missing or broken (TRITON_ERROR says why): the sdpa backend then keeps paged steps padded
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit(do_not_specialize=["first", "num_seqs", "stride_tb"])
    def _pack_kernel(
        k_cache_ptr, v_cache_ptr, k_out_ptr, v_out_ptr, tables_ptr, seq_lens_ptr, cu_q_ptr, cu_k_ptr, offsets_ptr,
        first, num_seqs, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tb,
        HEADS: tl.constexpr, DIM: tl.constexpr, ROW_P: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
        TILE: tl.constexpr,
    ):
        """Copy positions [chunk * CHUNK, its end) of the group's sequence `b` (the step's `first + b`), TILE
        tokens (rows of HEADS * DIM) at a time."""
        b = tl.program_id(0)
        chunk = tl.program_id(1)
        seq = first + b
        q_first = tl.load(cu_q_ptr + first)
        k_first = tl.load(cu_k_ptr + first)
        if chunk == 0:  # offsets: [2, num_seqs + 1], queries then keys
            tl.store(offsets_ptr + 1 + b, tl.load(cu_q_ptr + seq + 1) - q_first)
            tl.store(offsets_ptr + num_seqs + 2 + b, tl.load(cu_k_ptr + seq + 1) - k_first)
            if b == 0:
                tl.store(offsets_ptr, 0)
                tl.store(offsets_ptr + num_seqs + 1, 0)
        seq_len = tl.load(seq_lens_ptr + seq)
        base = tl.load(cu_k_ptr + seq) - k_first
        elems = tl.arange(0, ROW_P)
        elem_ok = elems < HEADS * DIM
        k_elem = (elems // DIM) * stride_kh + elems % DIM
        v_elem = (elems // DIM) * stride_vh + elems % DIM
        rows = tl.arange(0, TILE)
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, seq_len)
        for tile_start in range(start, end, TILE):  # empty when the chunk lies past the sequence
            pos = tile_start + rows
            live = pos < end
            page = tl.load(tables_ptr + seq.to(tl.int64) * stride_tb + pos // PAGE, mask=live, other=0).to(tl.int64)
            row = (pos % PAGE).to(tl.int64)
            mask = live[:, None] & elem_ok[None, :]
            dst = ((base + pos).to(tl.int64) * (HEADS * DIM))[:, None] + elems[None, :]
            k = tl.load(k_cache_ptr + (page * stride_kb + row * stride_kt)[:, None] + k_elem[None, :], mask=mask)
            tl.store(k_out_ptr + dst, k, mask=mask)
            v = tl.load(v_cache_ptr + (page * stride_vb + row * stride_vt)[:, None] + v_elem[None, :], mask=mask)
            tl.store(v_out_ptr + dst, v, mask=mask)


CHUNK = 128  # positions per program: enough programs for one long sequence, few idle ones for many short
TILE_ELEMENTS = 8192  # elements a program moves per load (of K, and again of V)


def pack_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, first: int, end: int, max_seqlen_k: int,
               k_out: torch.Tensor, v_out: torch.Tensor, offsets: torch.Tensor) -> None:
    """Copy the first `seq_lens[s]` tokens of each sequence s of [first, end) (pages named by `block_tables[s]`)
    from the caches [num_blocks, page, Hkv, D] into k_out, v_out [T, Hkv, D], at rows cu_seqlens_k[s] -
    cu_seqlens_k[first] on, and write offsets [2, end - first + 1] int32: cu_seqlens_q[first:end + 1] and
    cu_seqlens_k[first:end + 1] less their first entry. `max_seqlen_k` bounds every length, T their sum."""
    num_seqs = end - first
    kv_heads, dim, page = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or not k_out.is_contiguous() or not v_out.is_contiguous():
        raise ValueError("pack_pages needs caches with contiguous head rows and contiguous packed buffers")
    row_p = triton.next_power_of_2(kv_heads * dim)
    tile = max(1, min(CHUNK, TILE_ELEMENTS // row_p))
    grid = (num_seqs, max(1, -(-max_seqlen_k // CHUNK)))
    _pack_kernel[grid](
        k_cache, v_cache, k_out, v_out, block_tables, seq_lens, cu_seqlens_q, cu_seqlens_k, offsets, first, num_seqs,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0),
        HEADS=kv_heads, DIM=dim, ROW_P=row_p, PAGE=page, CHUNK=CHUNK, TILE=tile, num_warps=4,
    )


class PackedPages:
    """One backend's packed K/V buffer, shared by its layers (each layer's pack overwrites the last's).

    It holds `group` sequences of the longest context the engine allows; a step's sequences are packed and
    attended `group` at a time. The groups follow from the batch size alone, so a captured graph's groups
    serve every replay, and no step needs more room than the buffer has, whatever prefixes its sequences
    share. `budget` (bytes) bounds the buffer, down to one sequence of the longest context."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, max_num_seqs: int, budget: int):
        per_seq = 2 * max_model_len * num_kv_heads * head_dim * dtype.itemsize
        self.group = max(1, min(max_num_seqs, budget // per_seq))
        self.max_model_len = max_model_len
        shape = (self.group * max_model_len, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.offsets = torch.zeros(2 * (self.group + 1), dtype=torch.int32, device=device)

    def groups(self, meta) -> list[tuple[int, int, int, int]]:
        """(first sequence, end, first query token, end) of each group of the step (run on every step, replays
        included: a context past the engine's limit would not fit, and is refused here)."""
        if meta.max_seqlen_k > self.max_model_len:
            raise ValueError(f"a context of {meta.max_seqlen_k} tokens exceeds max_model_len {self.max_model_len}")
        query_lens = meta.query_lens_host
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        num_seqs = len(query_lens)
        return [(s, min(s + self.group, num_seqs), starts[s], starts[min(s + self.group, num_seqs)])
                for s in range(0, num_seqs, self.group)]

    def pack(self, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, first: int, end: int):
        """Sequences [first, end) of the step packed: (K, V, query offsets, key offsets) for varlen attention."""
        offsets = self.offsets[: 2 * (end - first + 1)].view(2, -1)
        pack_pages(k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.cu_seqlens_k, first,
                   end, meta.max_seqlen_k, self.k, self.v, offsets)
        return self.k, self.v, offsets[0], offsets[1]
