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
    def _settle(total, out, cols, mask, count_ptr, tile, SPLIT: tl.constexpr):
        """Write `total` at `out`, or, split, add it to the partials at `cols` and let the last of the output
        tile's SPLIT programs (counted at count_ptr + tile) write their sum and set partials and count to zero."""
        if SPLIT == 1:
            tl.store(out, total.to(out.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(cols, total, mask=mask)
            tl.debug_barrier()  # every thread's sums are in before the count (the atomic's fence orders them)
            if tl.atomic_add(count_ptr + tile, 1) == SPLIT - 1:
                nothing = tl.zeros(total.shape, tl.float32)
                done = tl.where(mask, tl.atomic_add(cols, nothing, mask=mask), 0.0)  # read at L2, where summed
                tl.store(out, done.to(out.dtype.element_ty), mask=mask)
                tl.store(cols, nothing, mask=mask)  # (no program of this call adds to them any more)
                tl.store(count_ptr + tile, 0)

    @triton.jit
    def finish(total, out_ptr, part_ptr, count_ptr, row, rn, n_ok, N, som, SPLIT: tl.constexpr):
        """_settle for a GEMV: `total`, columns rn of output row `row` (grid: rows, tiles, splits)."""
        _settle(total, out_ptr + row * som + rn, part_ptr + row * N + rn, n_ok, count_ptr,
                row * tl.num_programs(1) + tl.program_id(1), SPLIT)

    @triton.jit
    def finish_tile(acc, out_ptr, part_ptr, count_ptr, rn, rm, n_ok, m_ok, N, som, SPLIT: tl.constexpr):
        """_settle for a GEMM's transposed tile: `acc` [columns rn, rows rm] of the output (grid: column tiles,
        row tiles, splits)."""
        _settle(acc, out_ptr + rm[None, :] * som + rn[:, None], part_ptr + rm[None, :] * N + rn[:, None],
                n_ok[:, None] & m_ok[None, :], count_ptr, tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
                SPLIT)

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
