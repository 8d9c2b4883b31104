"""Sampling on the CPU by the inverse of each row's cumulative distribution: one uniform number a row, where
the plain sampler draws an exponential number for every logit (the CPU's generator takes most of a step's
sampling time at a large vocabulary): `sample` at a temperature alone, `sample_masked` the same under grammars'
bitmasks, `draw` over any row's filtered weights (top-k, top-p, min-p, seeded rows, speculative residuals).

Token i is drawn when u falls in its share of the row's cumulative sum of exp((logit - max) / T), which is
exactly softmax(logits / T)_i; u lies in (0, total], so a token of probability 0 (a -inf logit) is never drawn.
The cumulative sum is taken in two levels (each block's sum of BLOCK tokens, then the chosen block's own
cumulative sum): a full-width cumulative sum is a sequential pass, slower than the exp. The weights are written
into a buffer kept per thread (a fresh one of a 150k vocabulary's rows costs its page faults every step, more
than the pass), and a grammar's bitmask is turned into what the logits get added (0 or -inf) a byte at a time
from a table: a bool mask's masked_fill, or its conversion to floats, is several times slower here.
"""
from __future__ import annotations

import threading

import torch

BLOCK = 1024
_scratch = threading.local()
# a bitmask byte's 8 tokens as what their logits get added (0 where the bit allows the token, -inf where not)
# and what their weights are multiplied by (1 or 0)
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
_BYTE_BIAS = torch.where(_BYTE_BITS, 0.0, float("-inf"))
_BYTE_KEEP = _BYTE_BITS.float()
# exp(x) for x below this is a normal float or 0; the exp of -inf (or of a denormal's range) takes a slow path here
# several times slower than the pass
_LOWEST = -87.0


def _buffer(name: str, rows: int, width: int) -> torch.Tensor:
    """This thread's float32 [rows, width] buffer called `name` (grown as needed, never shrunk)."""
    buffers = _scratch.__dict__
    buffer = buffers.get(name)
    if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != width:
        buffer = buffers[name] = torch.empty(max(rows, 8), width)
    return buffer[:rows]


def _uniforms(rows: int, seed: int) -> torch.Tensor:
    return 1.0 - torch.rand(rows, generator=torch.Generator().manual_seed(seed))  # (0, 1]


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab], from softmax(logits / temperatures[:, None]) (temperatures
    float32 > 0), its uniform numbers keyed by `seed`."""
    weights = torch.div(logits, temperatures.unsqueeze(1), out=_buffer("weights", *logits.shape))
    weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()
    return draw(weights, _uniforms(logits.shape[0], seed))


def sample_masked(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, bitmask: torch.Tensor,
                  rows: torch.Tensor | None) -> torch.Tensor:
    """`sample` under grammars (Platform.grammar_sampler): the tokens a row's bitmask forbids never drawn, rows at
    temperature 0 their allowed argmax; `rows` maps each logits row to its bitmask row (-1: free), None for
    bitmask row i = logits row i. The same tokens as `sample` over the logits masked to -inf, for one seed."""
    count, vocab = logits.shape
    cold = temperatures == 0
    weights = torch.div(logits, torch.where(cold, 1.0, temperatures).unsqueeze(1),
                        out=_buffer("weights", count, vocab))
    if rows is not None:  # each logits row's bitmask row, all-allowed for a free row
        every = torch.cat([bitmask, torch.full_like(bitmask[:1], -1)])
        bitmask = every.index_select(0, torch.where(rows >= 0, rows, bitmask.shape[0]).long())
    indices = _add_bias(weights, bitmask)
    cold_rows = cold.nonzero().squeeze(1).tolist()
    greedy = torch.tensor([int(weights[row].argmax()) for row in cold_rows], dtype=torch.int64)
    # the allowed tokens' max first, then the forbidden ones' weights made exactly 0 by the table of 1s and 0s
    weights.sub_(weights.amax(dim=-1, keepdim=True)).clamp_(min=_LOWEST).exp_()
    keep = _expand(_BYTE_KEEP, indices, count, bitmask.shape[1])
    covered = min(vocab, keep.shape[1])
    weights[:, :covered].mul_(keep[:, :covered])
    weights[:, covered:] = 0.0
    tokens = draw(weights, _uniforms(count, seed))
    if cold_rows:
        tokens[cold_rows] = greedy
    return tokens


def mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """A copy of `logits` with the tokens a grammar forbids at -inf (Platform.grammar_masker): the bitmask rows
    added from the byte table; `rows` (int64 [masked]) the logits rows of the bitmask's rows, None for all."""
    out = logits.clone()
    if rows is None:
        _add_bias(out, bitmask)
    else:
        for i, row in enumerate(rows.tolist()):
            _add_bias(out[row:row + 1], bitmask[i:i + 1])
    return out


def _add_bias(values: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Add 0 or -inf to each token of `values` [rows, vocab] as `bitmask` [rows, words] allows it (tokens past the
    words: -inf); the bitmask's bytes as int64, for the table of 1s and 0s."""
    count, vocab = values.shape
    indices = bitmask.contiguous().view(torch.uint8).reshape(-1).long()
    bias = _expand(_BYTE_BIAS, indices, count, bitmask.shape[1])
    covered = min(vocab, bias.shape[1])
    values[:, :covered].add_(bias[:, :covered])
    values[:, covered:] = float("-inf")  # logits past the bitmask's words (padding): never allowed
    return indices


def _expand(table: torch.Tensor, indices: torch.Tensor, count: int, words: int) -> torch.Tensor:
    """Each bitmask byte (`indices`, int64) as its 8 entries of `table` [256, 8]: [count, words * 32] in this
    thread's buffer."""
    out = _buffer("table", count, words * 32)
    torch.index_select(table, 0, indices, out=out.view(-1, 8))
    return out


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token i of each row of `weights` [rows, vocab] (>= 0, any scale) where uniforms [rows] (in (0, 1]) times
    the row's total falls in its share of the cumulative sum (Platform.inverse_cdf_sampler). Zero weights are
    never drawn: the block and the token are each the first whose cumulative sum reaches what is left of the
    target, which a block or token of weight 0 never is before the one ahead of it."""
    count, vocab = weights.shape
    full = vocab // BLOCK * BLOCK
    sums = [weights[:, :full].reshape(count, -1, BLOCK).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(weights[:, full:].sum(dim=-1, keepdim=True))
    cumulative = torch.cumsum(torch.cat(sums, dim=1).double(), dim=-1)
    target = uniforms.double().unsqueeze(1) * cumulative[:, -1:]
    block = torch.searchsorted(cumulative, target).clamp_(max=cumulative.shape[1] - 1)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)), 0.0)
    starts = block * BLOCK
    columns = starts + torch.arange(BLOCK)
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).double().masked_fill_(columns >= vocab, 0.0)
    inside = torch.cumsum(inside, dim=-1)
    left = torch.minimum(target - before, inside[:, -1:])
    offset = torch.searchsorted(inside, left).clamp_(max=BLOCK - 1)
    return (starts + offset).squeeze(1).clamp_(max=vocab - 1)
