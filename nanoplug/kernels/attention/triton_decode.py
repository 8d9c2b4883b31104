"""Paged decode attention in Triton (flash-decoding), reading the cache as stored: float8 with its
per-layer scale, or a plain 16/32-bit cache.

One program per (sequence, KV head, split of the context). A program holds every query head of its KV
head (the GQA group), so each K/V tile is read from memory once for the whole group: a decode step is
bound by reading the cache, and fp8 halves those bytes. The split's partial output and log-sum-exp go
to float32 buffers, and a second small kernel merges the splits.

Two kernels, one per kind of cache. Over a 16/32-bit cache the query heads are the dots' rows (padded to
16), and K/V tiles feed the dots straight from shared memory. Over a float8 cache the tile's tokens are
the rows and the query heads the columns (padded to 8): K and V are widened to float16 in registers and
feed the dots from there, the padding costs half the tensor-core work, and the grid runs a sequence's KV
heads side by side (their rows are adjacent in the cache). A cache kept in Sylvester's Hadamard basis
(a RotatedKVLayer's, the fp8 store's: kernels/attention/rotated_cache.py) has q and the output turned inside that kernel by butterflies in
registers; any other rotation by two GEMMs around it (benchmarks/RESULTS.md, session 16).

The grid depends only on the batch size and the longest context the step may have (`max_seqlen_k`,
which is the model's limit for a captured graph), never on device values: a split past its
sequence's end writes an empty partial and returns. No host syncs, so it runs inside CUDA graphs.
Tile sizes, warps and stages are fixed (`DecodeConfig`), not autotuned, for the same reason.

On a GPU the dots run in the query's dtype, or in float16 over a float8 cache (K/V widen to it exactly
in one instruction, and q and the softmax weights lose nothing to it), with float32 accumulation; Triton's
CPU interpreter computes bfloat16 `tl.dot` wrong, so there the dots run in float32 (`IEEE`), and the
16-bit path is tested on the GPU only (tests/gpu/test_gpu_decode_kernel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoplug.api import import_triton, interpreting
from nanoplug.kernels.attention.rotated_cache import hadamard_of, rotation_of

# where triton is missing or broken (TRITON_ERROR says why): backends report the reason
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _program(seq_lens_ptr, b, kvh, window, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
        """This program's split (grid axis 2), the context positions [start, end) it covers (whole tiles, an
        empty range past the end), the first position its query sees (`first`: 0, or where a sliding window of
        `window` keys starts; the tiles before the one holding it are never read), and its query heads' and
        head dims' indices with their masks."""
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)  # a grid size, not a constexpr: one compiled kernel serves every count
        seq_len = tl.load(seq_lens_ptr + b)
        first = tl.maximum(seq_len - window, 0)  # `window` is FULL_CONTEXT for a layer of full attention
        origin = first // BLOCK_N * BLOCK_N  # tiles stay aligned to the context, and so to its pages
        tiles = (seq_len - origin + BLOCK_N - 1) // BLOCK_N  # (not tl.cdiv: a jit function the CPU
        per_split = (tiles + num_splits - 1) // num_splits * BLOCK_N  # interpreter runs only if triton was
        start = origin + split * per_split  # imported under it)
        end = tl.minimum(start + per_split, seq_len)
        rows = tl.arange(0, GROUP_P)
        dims = tl.arange(0, HEAD_DIM_P)
        return split, num_splits, start, end, first, kvh * GROUP + rows, rows < GROUP, dims, dims < HEAD_DIM

    @triton.jit
    def _load_tile(k_cache_ptr, v_cache_ptr, tables_ptr, b, kvh, stride_tb, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, tile_start, first, end, pos, live, dims, dim_ok,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TILE_IN_PAGE: tl.constexpr, FULL_TILES: tl.constexpr):
        """The tile's K and V rows [BLOCK_N, HEAD_DIM_P] of KV head `kvh`, as stored (V zero where not `live`)."""
        if TILE_IN_PAGE:  # the tile lies in one page: one table read, and rows the loads can vectorize
            page = tl.load(tables_ptr + b * stride_tb + tile_start // PAGE).to(tl.int64)
            row = (tile_start % PAGE + tl.arange(0, BLOCK_N))[:, None]
        else:  # a page per position
            page = tl.load(tables_ptr + b * stride_tb + pos // PAGE, mask=live, other=0).to(tl.int64)[:, None]
            row = (pos % PAGE)[:, None]
        k_rows = k_cache_ptr + page * stride_kb + row * stride_kt + kvh * stride_kh + dims[None, :]
        v_rows = v_cache_ptr + page * stride_vb + row * stride_vt + kvh * stride_vh + dims[None, :]
        if FULL_TILES:  # the tile lies in an allocated page: plain loads (faster over float8 and float32, slower
            # over a 16-bit cache on an H200); rows past `end` get p = 0 and their V is zeroed (a page's stale
            # NaN times 0 would still be NaN)
            k = tl.load(k_rows)
            v = tl.load(v_rows)
            if tile_start + BLOCK_N > end or tile_start < first:
                v = tl.where(live[:, None], v, 0.0)
        else:
            kv_mask = live[:, None] & dim_ok[None, :]
            k = tl.load(k_rows, mask=kv_mask, other=0.0)
            v = tl.load(v_rows, mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def _write_split(acc, m_i, l_i, b, split, num_splits, num_heads, heads, dims, out_mask, row_ok,
                     out_ptr, stride_ob, stride_oh, part_out_ptr, part_lse_ptr, HEAD_DIM_P: tl.constexpr):
        """acc [GROUP_P, HEAD_DIM_P]: with one split the normalized output goes straight to `out`; else the
        partial and its log2-sum-exp to the buffers."""
        if num_splits == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            empty = l_i == 0.0  # a split past the sequence's end: weight 0 in the merge, values 0 not garbage
            out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
            lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
            row = (b * num_heads + heads) * num_splits + split  # [B, H, S] layout
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM_P + dims[None, :], out, mask=out_mask)
            tl.store(part_lse_ptr + row, lse, mask=row_ok)

    @triton.jit
    def _butterflies(x, D: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
        """One stage of the fast Walsh-Hadamard transform over x's rows: rows i and i + H (i's bit H clear)
        become their sum and difference."""
        pairs = tl.permute(tl.reshape(x, [D // (2 * H), 2, H * G]), (0, 2, 1))
        a, b = tl.split(pairs)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [D, G])

    @triton.jit
    def _hadamard_rows(x, D: tl.constexpr, G: tl.constexpr, LOG2_D: tl.constexpr):
        """H x for x [D, G], H Sylvester's +-1 Hadamard matrix of order D = 2 ** LOG2_D (no memory traffic)."""
        for i in tl.static_range(LOG2_D):
            x = _butterflies(x, D, G, 1 << i)
        return x

    # the block table's address and row stride vary with the step (eager tables, graph buffers), the window with
    # the layer: not specialized on, or each alignment would compile a kernel of its own
    @triton.jit(do_not_specialize=["tables_ptr", "stride_tb", "window"])
    def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, qk_scale, window,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tb,
        stride_ob, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
        FULL_TILES: tl.constexpr,
    ):
        """Attention of one KV head's query group over one split of its sequence's context, over a 16/32-bit
        cache. `qk_scale` is the softmax scale times log2(e): the softmax runs in base 2."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split, num_splits, start, end, first, heads, row_ok, dims, dim_ok = _program(
            seq_lens_ptr, b, kvh, window, BLOCK_N, GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if IEEE:
            q = q.to(tl.float32)

        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        for tile_start in range(start, end, BLOCK_N):  # empty when the split lies past the sequence
            pos = tile_start + offs
            live = (pos < end) & (pos >= first)
            k, v = _load_tile(k_cache_ptr, v_cache_ptr, tables_ptr, b, kvh, stride_tb, stride_kb, stride_kt, stride_kh,
                              stride_vb, stride_vt, stride_vh, tile_start, first, end, pos, live, dims, dim_ok, PAGE,
                              BLOCK_N, TILE_IN_PAGE, FULL_TILES)
            k, v = k.to(q.dtype), v.to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(live[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile holds a live position: finite
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new
        _write_split(acc, m_i, l_i, b, split, num_splits, tl.num_programs(1) * GROUP, heads, dims,
                     row_ok[:, None] & dim_ok[None, :], row_ok, out_ptr, stride_ob, stride_oh, part_out_ptr,
                     part_lse_ptr, HEAD_DIM_P)

    @triton.jit(do_not_specialize=["tables_ptr", "stride_tb", "window"])
    def _decode_f8_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, rot_ptr, tables_ptr, seq_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, qk_scale, window,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tb,
        stride_ob, stride_oh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
        FULL_TILES: tl.constexpr, HADAMARD: tl.constexpr, LOG2_D: tl.constexpr,
    ):
        """The same over a float8 cache, transposed: scores [BLOCK_N, GROUP_P] = K q^T and the output
        [HEAD_DIM_P, GROUP_P] = V^T p. The scales are folded into the scores and the output (K and V stay
        exact in the dots' dtype). HADAMARD: the cache holds K R and V R with R = r H (r = R[0, 0], H
        Sylvester's), so q is turned by R here and the output by R^T = R."""
        kvh = tl.program_id(0)  # a sequence's KV heads side by side: their rows share the cache's lines
        b = tl.program_id(1)
        split, num_splits, start, end, first, heads, row_ok, dims, dim_ok = _program(
            seq_lens_ptr, b, kvh, window, BLOCK_N, GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P)
        q_t = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + dims[:, None],
                      mask=dim_ok[:, None] & row_ok[None, :], other=0.0).to(tl.float32)
        if HADAMARD:
            q_t = _hadamard_rows(q_t, HEAD_DIM_P, GROUP_P, LOG2_D) * tl.load(rot_ptr).to(tl.float32)
        # float8 widens to float16 in one instruction (to bfloat16 it takes a detour)
        dot_dtype = tl.float32 if IEEE else tl.float16
        q_t = q_t.to(dot_dtype)
        qk_scale = qk_scale * tl.load(k_scale_ptr)

        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([HEAD_DIM_P, GROUP_P], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + offs
            live = (pos < end) & (pos >= first)
            k, v = _load_tile(k_cache_ptr, v_cache_ptr, tables_ptr, b, kvh, stride_tb, stride_kb, stride_kt, stride_kh,
                              stride_vb, stride_vt, stride_vh, tile_start, first, end, pos, live, dims, dim_ok, PAGE,
                              BLOCK_N, TILE_IN_PAGE, FULL_TILES)
            k, v = k.to(dot_dtype), v.to(dot_dtype)  # exact: e4m3 values are float16 values
            if IEEE:
                s = tl.dot(k, q_t, input_precision="ieee")
            else:
                s = tl.dot(k, q_t)
            s = tl.where(live[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))  # every tile holds a live position: finite
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            if IEEE:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p, input_precision="ieee")
            else:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(dot_dtype))
            m_i = m_new
        acc = acc * tl.load(v_scale_ptr)
        if HADAMARD:
            acc = _hadamard_rows(acc, HEAD_DIM_P, GROUP_P, LOG2_D) * tl.load(rot_ptr).to(tl.float32)
        _write_split(tl.trans(acc), m_i, l_i, b, split, num_splits, tl.num_programs(0) * GROUP, heads, dims,
                     row_ok[:, None] & dim_ok[None, :], row_ok, out_ptr, stride_ob, stride_oh, part_out_ptr,
                     part_lse_ptr, HEAD_DIM_P)

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
                             NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                             SPLITS_P: tl.constexpr):
        """One (sequence, head): the splits' partial outputs weighted by their share of the softmax."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        splits = tl.arange(0, SPLITS_P)
        dims = tl.arange(0, HEAD_DIM_P)
        row = (b * NUM_HEADS + h) * num_splits + splits
        ok = splits < num_splits
        lse = tl.load(part_lse_ptr + row, mask=ok, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # the first split always holds the sequence's first token
        part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM_P + dims[None, :],
                       mask=ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)  # padded columns: never written
        out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)


LOG2E = 1.4426950408889634
FULL_CONTEXT = 1 << 30  # the window argument of a layer of full attention: longer than any context


@dataclass(frozen=True)
class DecodeConfig:
    """Launch settings. The defaults suit an H200 with head_dim 64-128 (benchmarks/gpu_decode_variants.py):
    a 128-token tile is 16 KiB of fp8 K per head, 4 warps, 3 pipeline stages over a 16-bit cache and 2 over
    a float8 one (faster on the bench run's batches: benchmarks/gpu_fp8_decode_workload.py); splits until
    about 4 programs per SM are in flight."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    num_stages_8bit: int = 2
    programs_per_sm: int = 4
    max_splits: int = 32


def num_splits(batch: int, kv_heads: int, max_seqlen_k: int, num_sms: int, cfg: DecodeConfig) -> int:
    """Splits of each context: enough programs to fill the GPU, never more than there are tiles.
    Depends on host values only (batch size and the step's longest possible context)."""
    tiles = max(1, -(-max_seqlen_k // cfg.block_n))
    want = -(-num_sms * cfg.programs_per_sm // max(1, batch * kv_heads))
    return max(1, min(want, tiles, cfg.max_splits))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, splits: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, cfg: DecodeConfig = DecodeConfig(),
                 rotation: torch.Tensor | None = None, hadamard: bool = False, window: int | None = None) -> torch.Tensor:
    """q: [B, H, D], one query per sequence at the end of its context of `seq_lens[b]` tokens (its own
    K/V already stored); caches [num_blocks, page, Hkv, D]; block_tables int32 [B, W]. -> [B, H, D].
    `rotation` [D, D]: the cache holds K and V times it (RotatedKVLayer.rotation); q and the output stay in the
    model's basis. `hadamard` (`is_hadamard(rotation)`, float8 caches): the kernel turns them; else two GEMMs
    around the kernel do (one rounding each, in q's dtype). `window`: the query sees only its context's last
    `window` keys (a sliding-window layer; the tiles before them are not read)."""
    fp8 = k_cache.element_size() == 1
    dim = q.shape[-1]
    if rotation is not None and not (hadamard and fp8 and dim & (dim - 1) == 0):
        q = torch.matmul(q, rotation)
        return torch.matmul(paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, k_scale, v_scale,
                                         cfg, window=window), rotation.T)
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, heads, dim = q.shape
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    dim_p = triton.next_power_of_2(dim)
    out = torch.empty_like(q)
    # allocated per call: inside a captured graph they come from (and stay in) its pool; float32 even when
    # unused (one split), so the kernel's signature, and its one compiled binary, stay the same
    if splits > 1:
        part_out = torch.empty(batch, heads, splits, dim_p, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = torch.empty(1, dtype=torch.float32, device=q.device)
    # float32 dots for float32 models, and always in the CPU interpreter (its bfloat16 tl.dot is wrong)
    ieee = q.dtype == torch.float32 or interpreting()
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
               out.stride(0), out.stride(1))
    tiling = dict(HEAD_DIM=dim, HEAD_DIM_P=dim_p, PAGE=page, BLOCK_N=cfg.block_n, IEEE=ieee,
                  TILE_IN_PAGE=page % cfg.block_n == 0, num_warps=cfg.num_warps)
    if fp8:
        if k_scale is None:  # a float8 cache without scales reads as scaled by 1
            k_scale = v_scale = torch.ones((), dtype=torch.float32, device=q.device)
        _decode_f8_kernel[(kv_heads, batch, splits)](
            q, k_cache, v_cache, k_scale, v_scale, rotation if rotation is not None else k_scale, block_tables,
            seq_lens, out, part_out, part_lse, scale * LOG2E, window or FULL_CONTEXT, *strides,
            GROUP=group, GROUP_P=max(8, triton.next_power_of_2(group)),
            FULL_TILES=page % cfg.block_n == 0 and dim == dim_p, HADAMARD=rotation is not None,
            LOG2_D=dim_p.bit_length() - 1, num_stages=cfg.num_stages_8bit, **tiling)
    else:
        _decode_split_kernel[(batch, kv_heads, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, scale * LOG2E, window or FULL_CONTEXT,
            *strides,
            GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)),
            FULL_TILES=page % cfg.block_n == 0 and dim == dim_p and k_cache.element_size() != 2,
            num_stages=cfg.num_stages, **tiling)
    if splits > 1:
        _merge_splits_kernel[(batch, heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), splits, NUM_HEADS=heads, HEAD_DIM=dim,
            HEAD_DIM_P=dim_p, SPLITS_P=triton.next_power_of_2(max(splits, cfg.max_splits)), num_warps=4,
        )
    return out


class TritonDecode:
    """A backend's decode steps through `paged_decode`: the splits are chosen once per step in `prepare`."""

    def __init__(self, spec, cfg: DecodeConfig = DecodeConfig()):
        self.spec, self.cfg = spec, cfg
        cuda = spec.device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(spec.device).multi_processor_count if cuda else 4
        self.splits = 1

    @staticmethod
    def serves(meta) -> bool:
        """Every sequence adds exactly one token at the end of its context (decode, and one-token chunks)."""
        return meta.max_seqlen_q == 1

    def prepare(self, meta) -> None:
        # max_seqlen_k is the model's limit in a captured graph, so a graph's grid fits every replay
        self.meta = meta
        # per window of the model's layers: a sliding window's tiles span at most one more than the window
        self.splits = {w: num_splits(meta.num_seqs, self.spec.num_kv_heads, meta.max_seqlen_k if w is None
                                     else min(meta.max_seqlen_k, w + self.cfg.block_n), self.num_sms, self.cfg)
                       for w in self.spec.windows}

    def forward(self, q, k_cache, v_cache, layer) -> torch.Tensor:
        meta, window = self.meta, self.spec.window(layer.index)
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.spec.scale, self.splits[window],
                            layer.k_scale, layer.v_scale, self.cfg, rotation_of(layer), hadamard_of(layer), window)
