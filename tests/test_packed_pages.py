"""The page-packing kernel of attention `sdpa` on CUDA (nanoplug/kernels/attention/packed_pages.py), on CPU through the
Triton interpreter, against a plain torch gather: contexts of one token, exactly a page, several pages and
several of the kernel's chunks, padded rows naming the scratch block, heads whose row is not a power of two,
bit for bit in float32 and bfloat16; nothing written past the packed tokens; a step split into groups (a
prefill with cached context) whose packed K/V and offsets give each sequence's causal attention; and the
sdpa backend's whole packed path in an engine, with a torch reference in place of the CUDA-only
`varlen_attn`, against attention `manual`.

The kernel runs under the interpreter for this module's tests only (tests/_triton_interpreter.py).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from _triton_interpreter import interpreted
from nanoplug.api import AttentionMetadata


@pytest.fixture(scope="module")
def packed():
    import nanoplug.kernels.attention.packed_pages as module

    with interpreted(module) as reloaded:
        yield reloaded


def layout(lengths: list[int], page: int, seed: int):
    """Caches of distinct random values, and block tables of random distinct pages padded with the scratch
    block (the last one), for sequences of these context lengths."""
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page) for n in lengths]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    width = max(pages) + 1  # a padding column in every row
    tables = torch.full((len(lengths), width), num_blocks - 1, dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    return tables


def reference(cache: torch.Tensor, tables: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    page = cache.shape[1]
    rows = []
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        rows.append(cache[tables[b, pos // page].long(), pos % page])
    return torch.cat(rows)


def meta_of(lengths: list[int], query_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    cu = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0).tolist()), dtype=torch.int32)  # noqa: E731
    return AttentionMetadata(
        is_prefill=max(query_lens) > 1, cu_seqlens_q=cu(query_lens), cu_seqlens_k=cu(lengths),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        block_tables=tables, max_seqlen_q=max(query_lens), max_seqlen_k=max(lengths),
        query_lens_host=list(query_lens), seq_lens_host=list(lengths),
    )


CASES = {  # name: (context lengths, page size, KV heads, head size)
    "one token, a page, pages, padding": ([1, 4, 11, 1, 7], 4, 2, 16),
    "rows not a power of two": ([3, 9, 1], 4, 3, 8),
    "several chunks and tiles per sequence": ([300, 129, 1, 128, 2], 16, 2, 64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_pack_equals_a_torch_gather(packed, case, dtype):
    lengths, page, heads, dim = CASES[case]
    tables = layout(lengths, page, seed=len(lengths))
    num_blocks = int(tables.max()) + 1
    k_cache = torch.randn(num_blocks, page, heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, page, heads, dim).to(dtype)
    k_cache[-1], v_cache[-1] = 0, 0  # the scratch block, zeroed as the engine keeps it
    total = sum(lengths)
    k_out = torch.full((total + 5, heads, dim), float("nan"), dtype=dtype)
    v_out = torch.full_like(k_out, float("nan"))
    offsets = torch.full((2, len(lengths) + 1), -1, dtype=torch.int32)
    meta = meta_of(lengths, [1] * len(lengths), tables)
    packed.pack_pages(k_cache, v_cache, tables, meta.seq_lens, meta.cu_seqlens_q, meta.cu_seqlens_k, 0,
                      len(lengths), max(lengths), k_out, v_out, offsets)
    assert torch.equal(k_out[:total], reference(k_cache, tables, lengths))
    assert torch.equal(v_out[:total], reference(v_cache, tables, lengths))
    assert k_out[total:].isnan().all() and v_out[total:].isnan().all()  # nothing past the packed tokens
    assert torch.equal(offsets[0], meta.cu_seqlens_q) and torch.equal(offsets[1], meta.cu_seqlens_k)


def varlen_reference(q, k, v, cu_q, cu_k, scale):
    """Causal attention of each sequence's queries (the last of its keys) over its keys, GQA by repetition."""
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        n_q, n_k = qs.shape[0], ks.shape[0]
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        rep = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.repeat_interleave(rep, 1).transpose(0, 1),
                                             vs.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def test_groups_of_a_step_attend_as_the_whole_step(packed):
    """A buffer with room for two sequences: a prefill over cached context of five sequences runs as three
    groups, and attention over each group's packed K/V and offsets equals attention over the step's."""
    lengths, query_lens, page, heads, dim = [9, 1, 16, 5, 12], [3, 1, 6, 5, 1], 4, 2, 8
    tables = layout(lengths, page, seed=7)
    num_blocks = int(tables.max()) + 1
    k_cache, v_cache = torch.randn(num_blocks, page, heads, dim), torch.randn(num_blocks, page, heads, dim)
    meta = meta_of(lengths, query_lens, tables)
    q = torch.randn(sum(query_lens), 2 * heads, dim)
    row_bytes = 2 * heads * dim * 4
    buffer = packed.PackedPages(heads, dim, torch.float32, torch.device("cpu"), max_model_len=16, max_num_seqs=8,
                                budget=2 * 16 * row_bytes)
    assert buffer.group == 2 and buffer.k.shape == (32, heads, dim)
    groups = buffer.groups(meta)
    assert groups == [(0, 2, 0, 4), (2, 4, 4, 15), (4, 5, 15, 16)]
    outs = []
    for first, end, q_first, q_end in groups:
        k, v, cu_q, cu_k = buffer.pack(k_cache, v_cache, meta, first, end)
        outs.append(varlen_reference(q[q_first:q_end], k, v, cu_q, cu_k, dim ** -0.5))
    whole = varlen_reference(q, reference(k_cache, tables, lengths), reference(v_cache, tables, lengths),
                             meta.cu_seqlens_q, meta.cu_seqlens_k, dim ** -0.5)
    assert torch.equal(torch.cat(outs), whole)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        buffer.groups(meta_of([17], [1], tables[:1]))


def varlen_as_in_torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                            window_size=(-1, -1)):
    """torch 2.11's `varlen_attn` (a CUDA-only op), by its documented meaning: causal (aligned to the bottom
    right) for window (-1, 0), else over every key; grouped-query K/V read as FlashAttention reads them."""
    assert window_size in ((-1, 0), (-1, -1)) and return_aux is None
    assert int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) <= max_q and int((cu_seq_k[1:] - cu_seq_k[:-1]).max()) <= max_k
    if window_size == (-1, -1):
        assert max_q == 1  # the backend drops the mask only where it changes nothing
    return varlen_reference(query, key, value, cu_seq_q.tolist(), cu_seq_k.tolist(), scale)


def test_the_packed_path_of_sdpa_gives_manuals_tokens_and_logits(packed, monkeypatch):
    """The sdpa backend's CUDA path on torch 2.11 (packed pages, then `varlen_attn`), run here on the CPU in
    float32 with the reference above in place of the CUDA op and a buffer of one sequence: decode steps of
    up to six sequences in groups, and prefill chunks over cached context (shared prefixes, small chunks),
    against attention `manual`."""
    import inspect

    from _checkpoints import checkpoint, relative_error
    from nanoplug import LLM, SamplingParams
    from nanoplug.kernels.attention import varlen_sdpa as sdpa_cuda

    fn = varlen_as_in_torch_2_11
    monkeypatch.setattr(sdpa_cuda, "_varlen", lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    monkeypatch.setattr(sdpa_cuda.CudaVarlenAttention, "usable", staticmethod(lambda spec: True))
    monkeypatch.setattr(sdpa_cuda, "packed_budget", lambda device: 1)  # one sequence per group
    story = list(range(3, 90))
    prompts = [story[:16], story[:40], story[:40] + [7, 8, 9], story[:5], story, [11]]
    params = SamplingParams(temperature=0, max_tokens=6, output_logits=True)
    runs = {}
    for attention in ("manual", "sdpa"):
        llm = LLM(checkpoint("qwen3"), kv_block_size=16, attention=attention, kv_cache="torch", num_kv_blocks=64,
                  max_model_len=128, max_num_batched_tokens=24)
        try:
            runs[attention] = llm.generate(prompts, params, use_tqdm=False)
            backend = llm.engine.worker.ctx.decode
        finally:
            llm.close()
    assert backend.cuda.packed.group == 1 and backend.supports_cuda_graphs
    assert {path for _, path in backend.paths} == {"varlen", "varlen, packed pages"}, backend.paths
    assert ("prefill", "varlen, packed pages") in backend.paths and ("decode", "varlen, packed pages") in backend.paths
    for want, got in zip(runs["manual"], runs["sdpa"], strict=True):
        assert got.token_ids == want.token_ids
        assert relative_error(torch.stack(got.logits), torch.stack(want.logits)) < 1e-5
