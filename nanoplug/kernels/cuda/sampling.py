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
    def _score(logits_ptr, cols, vocab, inv_t, noisy, u, bits_ptr, words, b, HAS_MASK: tl.constexpr):
        """Gumbel-perturbed scaled logits of `cols` (no noise where not `noisy`: a greedy row); -inf past the row's
        end and, under a grammar (bitmask row b >= 0; b < 0: a free row), where the bit of its words at `bits_ptr`
        is clear (tokens past the words are forbidden). u = 0 gives -inf too: never picked."""
        ok = cols < vocab
        if HAS_MASK:
            word = cols // 32
            masked = (word * 0 + b) >= 0  # (b broadcast first: the interpreter's & takes no scalar bool)
            bits = tl.load(bits_ptr + word, mask=ok & (word < words) & masked, other=0)
            ok = ok & ((((bits >> (cols % 32)) & 1) != 0) | ~masked)
        x = tl.load(logits_ptr + cols, mask=ok, other=float("-inf"))
        noise = tl.where(noisy, -tl.log(-tl.log(u)), 0.0)
        return tl.where(ok, x.to(tl.float32) * inv_t + noise, float("-inf"))

    @triton.jit
    def _keep_better(score, cols, best, where):
        better = score > best  # strict: among equal scores the earlier column stays
        return tl.where(better, score, best), tl.where(better, cols, where)

    @triton.jit(do_not_specialize=["seed"])  # a new seed each step must not pick another compiled variant
    def _gumbel_max_kernel(logits_ptr, temp_ptr, best_ptr, where_ptr, seed, vocab, stride_row, per_split,
                           bitmask_ptr, bitmask_rows_ptr, words,
                           SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr):
        """One slice of one row. Each Philox call gives four uniforms (tl.rand4x), one for each quarter of
        a block: the noise costs a quarter of one call per logit (offset row * vocab + column of the first
        quarter, so no two logits of a step share a number). A row at temperature 0 takes its argmax. Under a
        grammar (HAS_MASK) row r reads bitmask row r, or bitmask_rows[r] (HAS_ROWS; -1: a free row)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        t = tl.load(temp_ptr + row)
        noisy = t > 0
        inv_t = 1.0 / tl.where(noisy, t, 1.0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        b = row
        if HAS_ROWS:
            b = tl.load(bitmask_rows_ptr + row)
        bits_ptr = bitmask_ptr + tl.maximum(b, 0).to(tl.int64) * words
        lo = split * per_split
        Q: tl.constexpr = BLOCK // 4
        best = tl.full((Q,), float("-inf"), tl.float32)
        where = tl.zeros((Q,), tl.int32)
        for start in range(lo, lo + per_split, BLOCK):
            cols = start + tl.arange(0, Q)
            u0, u1, u2, u3 = tl.rand4x(seed, row.to(tl.int64) * vocab + cols)
            score = _score(row_ptr, cols, vocab, inv_t, noisy, u0, bits_ptr, words, b, HAS_MASK)
            best, where = _keep_better(score, cols, best, where)
            score = _score(row_ptr, cols + Q, vocab, inv_t, noisy, u1, bits_ptr, words, b, HAS_MASK)
            best, where = _keep_better(score, cols + Q, best, where)
            score = _score(row_ptr, cols + 2 * Q, vocab, inv_t, noisy, u2, bits_ptr, words, b, HAS_MASK)
            best, where = _keep_better(score, cols + 2 * Q, best, where)
            score = _score(row_ptr, cols + 3 * Q, vocab, inv_t, noisy, u3, bits_ptr, words, b, HAS_MASK)
            best, where = _keep_better(score, cols + 3 * Q, best, where)
        top = tl.max(best, axis=0)
        at = tl.min(tl.where(best == top, where, 2147483647), axis=0)
        tl.store(best_ptr + row * SPLITS + split, top)
        tl.store(where_ptr + row * SPLITS + split, at)

SPLITS, BLOCK = 16, 1024


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab] (any float dtype, last dim contiguous), drawn from
    softmax(logits / temperatures[:, None]) (temperatures float32, > 0) with noise keyed by `seed`."""
    return _draw(logits, temperatures, seed, None, None)


def sample_masked(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, bitmask: torch.Tensor,
                  rows: torch.Tensor | None) -> torch.Tensor:
    """`sample` under a grammar's bitmask, in the same one pass (the masked copy of the logits is never made):
    `bitmask` int32 [masked, words] on the device, bit j of word w allowing token 32 w + j (tokens past the
    words are forbidden); `rows` int32 [rows] on the device, the bitmask row of each logits row (-1: a free
    row), or None for bitmask row i = logits row i. A row at temperature 0 takes its (masked) argmax."""
    return _draw(logits, temperatures, seed, bitmask.contiguous(), rows)


def _draw(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, bitmask: torch.Tensor | None,
          rows: torch.Tensor | None) -> torch.Tensor:
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    per_split = triton.cdiv(triton.cdiv(vocab, SPLITS), BLOCK) * BLOCK
    best = torch.empty((n, SPLITS), dtype=torch.float32, device=logits.device)
    where = torch.empty((n, SPLITS), dtype=torch.int32, device=logits.device)
    if n:
        _gumbel_max_kernel[(n, SPLITS)](
            logits, temperatures.contiguous(), best, where, seed, vocab, logits.stride(0), per_split,
            where if bitmask is None else bitmask, where if rows is None else rows,
            0 if bitmask is None else bitmask.shape[1],
            SPLITS=SPLITS, BLOCK=BLOCK, HAS_MASK=bitmask is not None, HAS_ROWS=rows is not None, num_warps=4)
    return where.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).long()
