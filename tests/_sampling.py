"""The checks every platform's temperature sampler must pass, whatever draws its noise."""
from __future__ import annotations

import numpy as np
import torch


def check_temperature_sampler(sample, rows: int, slack: float) -> None:
    """`sample(logits, temperatures, seed)` over `rows` copies of one row: int64 tokens whose frequencies follow
    softmax(logits / T) within 4.5 sigma + `slack`, a -inf logit never drawn, the same seed the same tokens and
    another seed other tokens."""
    temperature = 0.7
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0, 1.5, float("-inf")]]).repeat(rows, 1)
    tokens = sample(logits.to(torch.bfloat16), torch.full((rows,), temperature), seed=123)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    freq = torch.bincount(tokens, minlength=8).double() / rows
    want = torch.softmax(logits[0].double() / temperature, dim=-1)
    sigma = (want * (1 - want) / rows).sqrt()
    assert freq[7] == 0, "a -inf logit was drawn"
    assert ((freq - want).abs() <= 4.5 * sigma + slack).all(), (freq, want)
    assert (sample(logits, torch.full((rows,), temperature), seed=124) != tokens).float().mean() > 0.2
    assert torch.equal(sample(logits.to(torch.bfloat16), torch.full((rows,), temperature), seed=123), tokens)


def grammar_case(rows: int, vocab: int, width: int, seed: int = 3):
    """Logits [rows, width] (wider than the bitmask's tokens), a bitmask [rows, words] allowing about half the
    tokens, and in every row a forbidden token far above the rest."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=g) * 3
    words = (vocab + 31) // 32
    allowed = torch.rand(rows, words * 32, generator=g) < 0.5
    allowed[:, vocab:] = False
    for row in range(rows):
        forbidden = int((~allowed[row, :vocab]).nonzero()[row % 3])
        logits[row, forbidden] = 80.0
    packed = np.packbits(allowed.numpy(), axis=1, bitorder="little").view(np.int32)
    return logits, torch.from_numpy(packed.copy())


def check_masked_draw(sample_masked, sample, masked_rows: list[int], vocab: int, width: int) -> None:
    """`sample_masked(logits, temperatures, seed, bitmask, rows)` gives exactly the tokens `sample` draws, with the
    same seed, from the logits the plain path masked (unpack, -inf), rows at temperature 0 their masked argmax,
    logits wider than the bitmask; `masked_rows` every row (no row map) or some (the others free)."""
    from nanoplug.api import SamplingBatch
    from nanoplug.worker.sampler import Sampler

    rows = 5
    logits, bitmask = grammar_case(rows, vocab, width)
    temps = torch.tensor([0.7, 0.0, 1.3, 1.0, 0.0])
    batch = SamplingBatch.greedy(rows)
    batch.mask_rows, batch.bitmask = masked_rows, bitmask[:len(masked_rows)]
    plain = Sampler(torch.device("cpu")).masked(logits, batch)
    of = [-1] * rows
    for i, row in enumerate(masked_rows):
        of[row] = i
    where = None if len(masked_rows) == rows else torch.tensor(of, dtype=torch.int32)
    for seed in (1, 2, 3):
        got = sample_masked(logits, temps, seed, batch.bitmask, where)
        want = sample(plain, torch.where(temps > 0, temps, 1.0), seed)
        want[temps == 0] = plain[temps == 0].argmax(dim=-1)
        assert got.tolist() == want.tolist()
        assert all(plain[row, got[row]] > float("-inf") for row in range(rows))
    if len(masked_rows) < rows:  # a free row keeps its forbidden-elsewhere token far above the rest
        assert got[0] == logits[0].argmax()
