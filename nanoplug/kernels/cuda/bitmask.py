"""A grammar's bitmask applied to the logits in one kernel (structured outputs): the tokens a row's bitmask forbids
set to -inf. The plain path unpacks the int32 words into a [rows, vocab] bool tensor first (a shift, an and, a
cast, a pad and a fill: about ten launches a step, which the host pays at every constrained step); this reads each
word where its 32 logits are and writes only the forbidden ones. On a CPU it runs only under TRITON_INTERPRET=1
(the tests).
"""
from __future__ import annotations

import torch

from nanoplug.api import import_triton

triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words, stride_row,
                              HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """One block of one masked row: bit j of word w allows token 32 w + j; tokens past the bitmask's
        words (padding of the logits) are never allowed."""
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row = tl.load(rows_ptr + i) if HAS_ROWS else i
        word = cols // 32
        bits = tl.load(bitmask_ptr + i.to(tl.int64) * words + word, mask=word < words, other=0)
        allowed = ((bits >> (cols % 32)) & 1) != 0
        tl.store(logits_ptr + row.to(tl.int64) * stride_row + cols, float("-inf"), mask=(cols < vocab) & ~allowed)

BLOCK = 4096


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """A copy of `logits` [batch, vocab] with -inf where the grammar forbids: `bitmask` int32 [masked, words] on
    the logits' device, row i of it for logits row `rows[i]` (int64 on the device; None: every row, in order)."""
    out = logits.clone(memory_format=torch.contiguous_format)
    masked, words = bitmask.shape
    if masked:
        bitmask = bitmask.contiguous()
        grid = (masked, triton.cdiv(out.shape[1], BLOCK))
        _apply_bitmask_kernel[grid](out, bitmask, rows if rows is not None else bitmask, out.shape[1], words,
                                    out.stride(0), HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=4)
    return out
