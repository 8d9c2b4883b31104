"""Triton kernels for per-request LoRA (the Punica / S-LoRA approach): each token's low-rank product reads
only its own adapter's factors, so what a step costs depends on its tokens, not on how many adapters are loaded.

The host, which knows every token's adapter, groups the adapted tokens of a step by adapter into tiles of
at most BLOCK_M tokens of one adapter (`plan_tiles`); the table goes to the device once per step and every
adapted layer reads it. Per layer two kernels run over the tiles, with the factors stacked as multi_lora.py
lays them out (A [S, K, R, in], B [out, S, K, R]: S packed slices such as q/k/v, K adapters, R the padded rank):

    shrink   h[t, s] = x[t] @ A[s, k].T                    x [T, in] -> h [T, S, R] (float32, split over `in`)
    expand   y[t, n] += h[t, s] @ B[n, s, k].T             only rows n of slice s, only tokens of adapter k

Each is a tl.dot over a tile, so an adapter's factors are read once per tile of up to BLOCK_M tokens, not
once per token (Punica's BGMV): a prefill of thousands of tokens stays a few small GEMMs. Accumulation is
float32. Block sizes are constexpr and fixed (no autotuning), and grids depend only on the shapes (the
tokens of the launch, K, the layer's sizes): entries past the step's tiles say adapter -1 and their programs
return at once, so the launches are captured in a CUDA graph as they are and replay each step's table.
On a CPU they run only under TRITON_INTERPRET=1 set before this module is imported (the tests).
"""
from __future__ import annotations


import numpy as np
import torch

from nanoplug.api import AdapterError, import_triton, interpreting, triton_reasons

# where triton is missing or broken (TRITON_ERROR says why): per-request LoRA keeps its plain path, never a crash
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _tile(tiles_ptr, order_ptr, BLOCK_M: tl.constexpr):
        """This program's tile: its adapter (-1: none, return), and its tokens' rows with their mask."""
        tile = tl.program_id(0)
        k = tl.load(tiles_ptr + tile * 3)
        start = tl.load(tiles_ptr + tile * 3 + 1)
        end = tl.load(tiles_ptr + tile * 3 + 2)
        m = start + tl.arange(0, BLOCK_M)
        mmask = m < end
        rows = tl.load(order_ptr + m, mask=mmask, other=0).to(tl.int64)
        return k, rows, mmask

    @triton.jit(do_not_specialize=["stride_hp"])  # T * S * R: one compile for every step's number of tokens
    def _shrink_kernel(x_ptr, a_ptr, h_ptr, tiles_ptr, order_ptr, IN, K, R, CHUNK, stride_x, stride_hp, stride_h,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_IN: tl.constexpr, IEEE: tl.constexpr):
        """h[p, t, s, :] = x[t, chunk p] @ A[s, k, :, chunk p].T for the tokens t of one tile (adapter k)."""
        k, rows, mmask = _tile(tiles_ptr, order_ptr, BLOCK_M)
        if k < 0:
            return
        s = tl.program_id(1)
        part = tl.program_id(2)
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        a_rows = a_ptr + ((s * K + k) * R + r).to(tl.int64) * IN
        x_rows = x_ptr + rows * stride_x
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for i0 in range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, IN), BLOCK_IN):
            i = i0 + tl.arange(0, BLOCK_IN)
            imask = i < IN
            xt = tl.load(x_rows[:, None] + i[None, :], mask=mmask[:, None] & imask[None, :], other=0.0)
            at = tl.load(a_rows[:, None] + i[None, :], mask=rmask[:, None] & imask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xt, tl.trans(at), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(at))
        out = h_ptr + part * stride_hp + rows[:, None] * stride_h + s * R + r[None, :]
        tl.store(out, acc, mask=mmask[:, None] & rmask[None, :])

    @triton.jit(do_not_specialize=["stride_hp"])
    def _expand_kernel(h_ptr, b_ptr, y_ptr, tiles_ptr, order_ptr, cols_ptr, K, R, stride_hp, stride_h, stride_b,
                       stride_y, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """y[t, n] += h[t, s, :] @ B[n, s, k, :] for the tokens t of one tile (adapter k) and one block of the
        output rows n of slice s (`cols`: slice, first row, end row)."""
        k, rows, mmask = _tile(tiles_ptr, order_ptr, BLOCK_M)
        if k < 0:
            return
        cb = tl.program_id(1)
        s = tl.load(cols_ptr + cb * 3)
        n0 = tl.load(cols_ptr + cb * 3 + 1)
        n1 = tl.load(cols_ptr + cb * 3 + 2)
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        hmask = mmask[:, None] & rmask[None, :]
        h_at = h_ptr + rows[:, None] * stride_h + s * R + r[None, :]
        h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for p in tl.static_range(PARTS):  # the shrink's partial sums over chunks of the input
            h += tl.load(h_at + p * stride_hp, mask=hmask, other=0.0)
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < n1
        b = tl.load(b_ptr + n.to(tl.int64)[:, None] * stride_b + (s * K + k) * R + r[None, :],
                    mask=nmask[:, None] & rmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(h, tl.trans(b), input_precision="ieee")
        else:  # in the factors' dtype, as the plain path's second matmul (h rounded once, to bf16 or fp16)
            acc = tl.dot(h.to(b.dtype), tl.trans(b))
        ymask = mmask[:, None] & nmask[None, :]
        y_at = y_ptr + rows[:, None] * stride_y + n[None, :]
        y = tl.load(y_at, mask=ymask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + acc).to(y_ptr.dtype.element_ty), mask=ymask)


BLOCK_M = 16    # tokens of one adapter per tile: tl.dot's smallest M; decode steps rarely have more per adapter
BLOCK_IN = 64   # input features per shrink iteration
CHUNK_IN = 256  # input features per shrink program: a layer's shrink splits its input into this many (more programs)
BLOCK_N = 64    # output rows per expand program
INTERPRETED = interpreting()  # how the kernels above were defined


def unavailable(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Why the kernels cannot serve a model on `device` in `dtype` (empty: they can)."""
    if triton is None:
        return triton_reasons(TRITON_ERROR, device.type)
    if device.type == "cuda":
        return [] if dtype in (torch.float16, torch.bfloat16, torch.float32) else [f"no kernels for {dtype}"]
    if device.type == "cpu" and INTERPRETED and interpreting():
        return [] if dtype == torch.float32 else ["under the Triton interpreter they compute in float32 only"]
    return triton_reasons(None, device.type)


def max_tiles(num_tokens: int, num_adapters: int) -> int:
    """Tiles `num_tokens` tokens can make at most: each adapter's tokens fill whole tiles but its last."""
    return -(-num_tokens // BLOCK_M) + min(num_adapters, num_tokens)


def plan_size(max_tokens: int, num_adapters: int) -> int:
    """Length of the int32 plan buffer: the tile table (adapter, start, end per tile), then the token order."""
    return 3 * max_tiles(max_tokens, num_adapters) + max_tokens


def plan_tiles(ids: np.ndarray, num_adapters: int, max_tokens: int) -> np.ndarray:
    """One step's plan (int32, up to `plan_size`): the tile table, every entry past the step's tiles adapter -1,
    then the adapted tokens' indices grouped by adapter. `ids`: each token's adapter id (0: none, k + 1: k)."""
    table = max_tiles(max_tokens, num_adapters)
    counts = np.bincount(ids, minlength=num_adapters + 1)[1:]
    order = np.argsort(ids, kind="stable")[ids.shape[0] - int(counts.sum()):]  # id 0 sorts first: dropped
    per_adapter = -(-counts // BLOCK_M)
    first = np.cumsum(counts) - counts  # where each adapter's tokens start in `order`
    adapter = np.repeat(np.arange(num_adapters), per_adapter)
    within = np.arange(adapter.shape[0]) - np.repeat(np.cumsum(per_adapter) - per_adapter, per_adapter)
    start = first[adapter] + within * BLOCK_M
    plan = np.empty(3 * table + order.shape[0], dtype=np.int32)
    tiles = plan[:3 * table].reshape(table, 3)
    tiles[:] = -1
    end = np.minimum(start + BLOCK_M, first[adapter] + counts[adapter])
    tiles[:adapter.shape[0]] = np.stack([adapter, start, end], 1)
    plan[3 * table:] = order
    return plan


def column_blocks(slices: dict[int, tuple[int, int]], device: torch.device) -> torch.Tensor:
    """A layer's expand work: (slice, first row, end row) of each block of BLOCK_N output rows, int32 [blocks, 3].
    `slices`: the output rows (offset, count) each adapted slice's B fills (a slice no adapter targets has none)."""
    spans = sorted((offset, offset + size) for offset, size in slices.values())
    if any(end > nxt for (_, end), (nxt, _) in zip(spans, spans[1:])):
        raise AdapterError(f"packed slices {slices} share output rows, which the per-request LoRA kernels cannot "
                           "serve; merge this adapter (merge=True)")
    blocks = [(s, n, min(n + BLOCK_N, offset + size)) for s, (offset, size) in sorted(slices.items())
              for n in range(offset, offset + size, BLOCK_N)]
    return torch.tensor(blocks, dtype=torch.int32, device=device).reshape(-1, 3)


def add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tiles: torch.Tensor,
             order: torch.Tensor, columns: torch.Tensor, num_slices: int, num_adapters: int, rank: int) -> torch.Tensor:
    """y [T, out] += each token's own adapter's x @ A.T @ B.T, in place, for the tokens the step's tiles list.
    a: [S*K*R, in], b: [out, S*K*R] (as multi_lora.py stacks them); tiles/order: the step's plan on the device;
    columns: the layer's `column_blocks`."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = y if y.stride(-1) == 1 else y.contiguous()
    num_tokens, in_features = x.shape
    parts = -(-in_features // CHUNK_IN)
    h = torch.empty(parts, num_tokens, num_slices * rank, dtype=torch.float32, device=x.device)
    grid_m = max_tiles(num_tokens, num_adapters)
    block_r = max(16, triton.next_power_of_2(rank))
    ieee = x.dtype == torch.float32
    _shrink_kernel[(grid_m, num_slices, parts)](
        x, a, h, tiles, order, in_features, num_adapters, rank, CHUNK_IN, x.stride(0), h.stride(0), h.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_IN=BLOCK_IN, IEEE=ieee, num_warps=4)
    _expand_kernel[(grid_m, columns.shape[0])](
        h, b, out, tiles, order, columns, num_adapters, rank, h.stride(0), h.stride(1), b.stride(0), out.stride(0),
        PARTS=parts, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N, IEEE=ieee, num_warps=4)
    return y if out is y else y.copy_(out)
