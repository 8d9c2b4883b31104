"""Split-K GEMVs and GEMMs in one launch: K split over programs whose float32 sums meet in shared partials, the last
program of each output tile (a per-tile count) writing the output and setting the partials and the count back to
zero: no zeroing launch before and no conversion launch after (a split GEMV was three launches). The buffers are
zero between calls, so one pair per device serves every layer, both kernels and every CUDA graph: the engines
queue all their work on the device's one stream, so no two GEMVs overlap."""
from __future__ import annotations

import torch

from nanoplug.api import import_triton

triton, tl, TRITON_ERROR = import_triton()
_BUFFERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[torch.Tensor] = []  # buffers replaced by bigger ones: graphs captured on them still use them


if triton is not None:
    @triton.jit
    def finish(total, out_ptr, part_ptr, count_ptr, row, rn, n_ok, N, som, SPLIT: tl.constexpr):
        """Write `total` (columns rn of output row `row`), or, split, add it to the partials and let the last of
        the tile's SPLIT programs write their sum (grid: rows, tiles, splits)."""
        out = out_ptr + row * som + rn
        if SPLIT == 1:
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            cols = part_ptr + row * N + rn
            tl.atomic_add(cols, total, mask=n_ok)
            tl.debug_barrier()  # every thread's sums are in before the count (the atomic's fence orders them)
            tile = row * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(count_ptr + tile, 1) == SPLIT - 1:
                nothing = tl.zeros(total.shape, tl.float32)
                done = tl.where(n_ok, tl.atomic_add(cols, nothing, mask=n_ok), 0.0)  # read at L2, where summed
                tl.store(out, done.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.store(cols, nothing, mask=n_ok)  # (no program of this call adds to them any more)
                tl.store(count_ptr + tile, 0)

    @triton.jit
    def finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT: tl.constexpr):
        """finish for a GEMM's transposed tile: `acc` [columns rn, rows rm] of the output (grid: column tiles, row
        tiles, splits)."""
        out = out_ptr + rm[None, :] * som + rn[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT == 1:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            cols = part_ptr + rm[None, :] * N + rn[:, None]
            tl.atomic_add(cols, acc, mask=mask)
            tl.debug_barrier()
            tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(count_ptr + tile, 1) == SPLIT - 1:
                nothing = tl.zeros(acc.shape, tl.float32)
                done = tl.where(mask, tl.atomic_add(cols, nothing, mask=mask), 0.0)
                tl.store(out, done.to(out_ptr.dtype.element_ty), mask=mask)
                tl.store(cols, nothing, mask=mask)
                tl.store(count_ptr + tile, 0)


def buffers(device: torch.device, values: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 partials (at least `values`) and int32 counts (at least `tiles`) on `device`, zeros. Grown at a
    layer's first (eager) call, before a graph captures it; an outgrown pair is kept alive for graphs that hold it."""
    part, count = _BUFFERS.get(device, (None, None))
    if part is None or part.numel() < values or count.numel() < tiles:
        if part is not None:
            _OUTGROWN.extend((part, count))
            values, tiles = max(values, part.numel()), max(tiles, count.numel())
        part = torch.zeros(values, device=device, dtype=torch.float32)
        count = torch.zeros(tiles, device=device, dtype=torch.int32)
        _BUFFERS[device] = part, count
    return part, count
