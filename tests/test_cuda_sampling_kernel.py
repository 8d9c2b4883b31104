"""The CUDA platform's one-pass temperature sampler (nanoplug/kernels/cuda/sampling.py), on CPU through the
Triton interpreter: its draws follow softmax(logits / T) as the plain sampler's do, a token far above the rest is
found in whichever slice of the row it lies, -inf logits are never drawn, the same seed gives the same tokens;
and the engine's Sampler sends temperature-only batches to a platform's temperature sampler (rows at
temperature 0 greedy) and every other batch to its plain path.

The kernel runs under the interpreter for this module's tests only (tests/_triton_interpreter.py), which runs its
programs one by one: the distribution test cuts each row into one slice to keep the count of programs low.
"""
from __future__ import annotations

import pytest
import torch

from _sampling import check_masked_draw, check_temperature_sampler, grammar_case
from _triton_interpreter import interpreted
from nanoplug.api import SamplingBatch
from nanoplug.worker.sampler import Sampler


@pytest.fixture(scope="module")
def kernel():
    import nanoplug.kernels.cuda.sampling as module

    with interpreted(module) as reloaded:
        yield reloaded


def test_draws_follow_softmax_of_logits_over_temperature(kernel, monkeypatch):
    monkeypatch.setattr(kernel, "SPLITS", 1)
    check_temperature_sampler(kernel.sample, rows=1500, slack=1e-3)


def test_a_dominant_token_is_found_in_any_slice_of_a_long_row(kernel):
    vocab, rows = 3000, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    places = [0, 1023, 1700, vocab - 1]  # first slice, a block's edge, a middle slice, the last column
    for row, place in enumerate(places):
        logits[row, place] = 80.0
    tokens = kernel.sample(logits, torch.tensor([1.0, 0.5, 2.0, 1.0]), seed=7)
    assert tokens.tolist() == places


class Recording:
    def __init__(self):
        self.calls = []

    def __call__(self, logits, temperatures, seed):
        self.calls.append((temperatures.clone(), seed))
        return torch.full((logits.shape[0],), 5, dtype=torch.int64)


def rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None) -> SamplingBatch:
    def each(value):
        return list(value) if isinstance(value, list) else [value] * n

    return SamplingBatch(each(temperature), each(top_k), each(top_p), each(min_p), each(seed), list(range(n)))


def test_the_sampler_routes_temperature_only_batches_to_the_platform_sampler():
    fast = Recording()
    sampler = Sampler(torch.device("cpu"), seed=3, temperature=fast)
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    tokens = sampler(logits, rows(3, temperature=[0.8, 0.0, 1.2]))
    assert len(fast.calls) == 1
    temps, seed = fast.calls[0]
    assert temps.tolist() == pytest.approx([0.8, 1.0, 1.2]) and isinstance(seed, int)
    assert tokens.tolist() == [5, int(logits[1].argmax()), 5], "a row at temperature 0 is greedy"
    sampler(logits, rows(3))
    assert fast.calls[1][1] != seed, "each step keys its noise anew"
    for filtered in (rows(3, top_k=4), rows(3, top_p=0.9), rows(3, min_p=0.1), rows(3, seed=[None, 11, None])):
        sampler(logits, filtered)
    assert len(fast.calls) == 2, "a batch with a filter or a seeded row took the fast path"
    sampler(logits, rows(3, temperature=0.0))
    assert len(fast.calls) == 2, "an all-greedy batch took the sampler"


@pytest.mark.parametrize("masked_rows", [[0, 1, 2, 3, 4], [1, 3]], ids=["every-row", "some-rows"])
def test_the_masked_draw_equals_the_draw_over_the_plainly_masked_logits(kernel, monkeypatch, masked_rows):
    """`sample_masked` (mask and draw in one pass, no masked copy) draws as `sample` over the plainly masked
    logits."""
    monkeypatch.setattr(kernel, "SPLITS", 2)
    check_masked_draw(kernel.sample_masked, kernel.sample, masked_rows, vocab=1500, width=1530)


class RecordingGrammarDraw:
    def __init__(self):
        self.calls = []

    def __call__(self, logits, temperatures, seed, bitmask, rows):
        self.calls.append((temperatures.clone(), bitmask.clone(), None if rows is None else rows.tolist()))
        return torch.full((logits.shape[0],), 7, dtype=torch.int64)


def test_the_sampler_masks_and_draws_temperature_only_batches_under_grammars_in_one_call():
    """A batch under grammars with no filter, seed, penalty or drafts goes to the platform's grammar sampler
    whole (temperatures as given, 0 included; each row's bitmask row, -1 for a free row); any other batch under
    grammars is masked first and sampled as before."""
    from nanoplug.api import LogitsProcessingBatch

    fast = RecordingGrammarDraw()
    sampler = Sampler(torch.device("cpu"), seed=3, grammar_draw=fast)
    logits, bitmask = grammar_case(3, 60, width=64)
    batch = rows(3, temperature=[0.8, 0.0, 1.2])
    batch.mask_rows, batch.bitmask = [0, 2], bitmask[:2].numpy()
    assert sampler(logits, batch).tolist() == [7, 7, 7]
    temps, sent, where = fast.calls[0]
    assert temps.tolist() == pytest.approx([0.8, 0.0, 1.2]) and torch.equal(sent, bitmask[:2]) and where == [0, -1, 1]
    every = rows(3)
    every.mask_rows, every.bitmask = [0, 1, 2], bitmask.numpy()
    sampler(logits, every)
    assert fast.calls[1][2] is None, "every row masked in order: no row map"
    for other in (rows(3, top_k=4), rows(3, seed=[None, 11, None])):
        other.mask_rows, other.bitmask = [0, 1, 2], bitmask.numpy()
        tokens = sampler(logits, other)
        assert all(sampler.masked(logits, every)[r, t] > float("-inf") for r, t in enumerate(tokens.tolist()))
    penalized = rows(3)
    penalized.mask_rows, penalized.bitmask = [0, 1, 2], bitmask.numpy()
    penalized.processing = LogitsProcessingBatch()
    sampler(logits, penalized)
    assert len(fast.calls) == 2, "a filtered, seeded or penalized batch took the one-pass path"
