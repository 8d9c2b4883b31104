"""Sampling at a temperature, nothing else (no top-k, top-p, min-p or per-request seed), in one pass over the
logits: the Gumbel-max draw argmax(logits / T + G), G = -log(-log(U)), which picks token i with probability
softmax(logits / T)_i, as the engine's plain exponential race does. The plain path makes several full passes
(float32 copy, softmax, noise, division, argmax) over a [batch, vocab] tensor; this reads the logits once and
draws its noise in registers (Philox, keyed by a per-step seed and the element's index, four numbers a call).

Each row is cut into SPLITS slices; a program finds the best score of one slice, and a small reduction over the
slices picks the row's token. On a CPU the kernel runs only under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch

from nanoplug.api import import_triton

# where triton is missing or broken (TRITON_ERROR says why): the engine's plain sampler
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _score(logits_ptr, cols, vocab, inv_t, u):
        """Gumbel-perturbed scaled logits of `cols`; -inf past the row's end (u = 0 gives -inf: never picked)."""
        ok = cols < vocab
        x = tl.load(logits_ptr + cols, mask=ok, other=float("-inf"))
        return tl.where(ok, x.to(tl.float32) * inv_t - tl.log(-tl.log(u)), float("-inf"))

    @triton.jit
    def _keep_better(score, cols, best, where):
        better = score > best  # strict: among equal scores the earlier column stays
        return tl.where(better, score, best), tl.where(better, cols, where)

    @triton.jit(do_not_specialize=["seed"])  # a new seed each step must not pick another compiled variant
    def _gumbel_max_kernel(logits_ptr, inv_temp_ptr, best_ptr, where_ptr, seed, vocab, stride_row, per_split,
                           SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """One slice of one row. Each Philox call gives four uniforms (tl.rand4x), one for each quarter of
        a block: the noise costs a quarter of one call per logit (offset row * vocab + column of the first
        quarter, so no two logits of a step share a number)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        inv_t = tl.load(inv_temp_ptr + row)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        lo = split * per_split
        Q: tl.constexpr = BLOCK // 4
        best = tl.full((Q,), float("-inf"), tl.float32)
        where = tl.zeros((Q,), tl.int32)
        for start in range(lo, lo + per_split, BLOCK):
            cols = start + tl.arange(0, Q)
            u0, u1, u2, u3 = tl.rand4x(seed, row.to(tl.int64) * vocab + cols)
            best, where = _keep_better(_score(row_ptr, cols, vocab, inv_t, u0), cols, best, where)
            best, where = _keep_better(_score(row_ptr, cols + Q, vocab, inv_t, u1), cols + Q, best, where)
            best, where = _keep_better(_score(row_ptr, cols + 2 * Q, vocab, inv_t, u2), cols + 2 * Q, best, where)
            best, where = _keep_better(_score(row_ptr, cols + 3 * Q, vocab, inv_t, u3), cols + 3 * Q, best, where)
        top = tl.max(best, axis=0)
        at = tl.min(tl.where(best == top, where, 2147483647), axis=0)
        tl.store(best_ptr + row * SPLITS + split, top)
        tl.store(where_ptr + row * SPLITS + split, at)

SPLITS, BLOCK = 16, 1024


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab] (any float dtype, last dim contiguous), drawn from
    softmax(logits / temperatures[:, None]) (temperatures float32, > 0) with noise keyed by `seed`."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    per_split = triton.cdiv(triton.cdiv(vocab, SPLITS), BLOCK) * BLOCK
    best = torch.empty((rows, SPLITS), dtype=torch.float32, device=logits.device)
    where = torch.empty((rows, SPLITS), dtype=torch.int32, device=logits.device)
    if rows:
        _gumbel_max_kernel[(rows, SPLITS)](logits, (1.0 / temperatures).contiguous(), best, where, seed, vocab,
                                           logits.stride(0), per_split, SPLITS=SPLITS, BLOCK=BLOCK, num_warps=4)
    return where.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()
