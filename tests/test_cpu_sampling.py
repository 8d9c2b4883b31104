"""The cpu platform's samplers (nanoplug/kernels/cpu/sampling.py): the temperature sampler's draws follow
softmax(logits / T) as the plain sampler's do, a -inf logit is never drawn, the same seed gives the same
tokens, and so for the inverse-CDF draw over unnormalised weights; a CPU engine sends temperature-only batches
to the first, seeded and filtered ones to the second."""
from __future__ import annotations

import pytest
import torch

from _checkpoints import PROMPTS, checkpoint
from _sampling import check_masked_draw, check_temperature_sampler
from nanoplug import LLM, SamplingParams
from nanoplug.kernels.cpu import sampling


def test_draws_follow_softmax_of_logits_over_temperature():
    check_temperature_sampler(sampling.sample, rows=20000, slack=1e-4)


def test_the_inverse_cdf_draw_follows_the_weights_whatever_their_scale():
    def sample(logits, temperatures, seed):  # weights summing to 3.7, not 1; one uniform a row from the seed
        weights = torch.softmax(logits.float() / temperatures.unsqueeze(1), dim=-1) * 3.7
        u = 1.0 - torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(seed))
        return sampling.draw(weights, u)

    check_temperature_sampler(sample, rows=20000, slack=1e-4)
    weights = torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    assert sampling.draw(weights, torch.tensor([1e-9, 1.0, 1.0])).tolist() == [2, 0, 3]  # the ends: no 0 weight
    # several blocks, one all zero, many zero weights: the token the one-level inverse of the row's cumulative
    # sum gives (in float64), never a zero weight
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(64, 5000, generator=gen) ** 8
    weights[weights < 0.3] = 0.0
    weights[:, 1024:2048] = 0.0
    weights[0, :4096] = 0.0  # all of row 0 in the last, partial block
    u = 1.0 - torch.rand(64, generator=gen)
    cumulative = torch.cumsum(weights.double(), dim=-1)
    want = torch.searchsorted(cumulative, u.double().unsqueeze(1) * cumulative[:, -1:]).squeeze(1)
    got = sampling.draw(weights, u)
    assert got.tolist() == want.tolist() and bool((weights.gather(1, got.unsqueeze(1)) > 0).all())


@pytest.mark.parametrize("masked_rows", [[0, 1, 2, 3, 4], [1, 3]], ids=["every-row", "some-rows"])
def test_the_masked_draw_equals_the_draw_over_the_plainly_masked_logits(masked_rows):
    """`sample_masked` (the bitmask added from a table, weights zeroed by another) draws as `sample` over the
    plainly masked logits, over several blocks of the two-level draw."""
    check_masked_draw(sampling.sample_masked, sampling.sample, masked_rows, vocab=2500, width=2530)


def test_each_row_has_its_own_temperature_and_never_draws_a_masked_token():
    vocab = 50000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, : vocab - 1] -= 100.0  # all the mass on the last token...
    logits[2, -1] = float("-inf")  # ...but in row 2, which must pick from the rest
    tokens = sampling.sample(logits, torch.tensor([1.0, 0.05, 1.0]), seed=7)
    assert tokens[:2].tolist() == [vocab - 1, vocab - 1]
    assert 0 <= tokens[2] < vocab - 1


def test_a_cpu_engine_samples_temperature_only_batches_through_it(monkeypatch):
    """Temperature-only batches through `sample`, seeded ones through `draw`, grammars' through `sample_masked`."""
    calls, draws, masked = [], [], []
    sample, draw, sample_masked = sampling.sample, sampling.draw, sampling.sample_masked
    monkeypatch.setattr(sampling, "sample", lambda *a: calls.append(a[0].shape) or sample(*a))
    monkeypatch.setattr(sampling, "draw", lambda *a: draws.append(a[0].shape) or draw(*a))
    monkeypatch.setattr(sampling, "sample_masked", lambda *a: masked.append(a[0].shape) or sample_masked(*a))
    options = dict(device="cpu", dtype="float32", attention="sdpa", kv_cache="torch", max_model_len=128, seed=3)
    with LLM(checkpoint(), **options) as llm:
        hot = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
        first = [o.token_ids for o in llm.generate(PROMPTS[:2], hot, use_tqdm=False)]
        assert calls and all(shape[0] == 2 for shape in calls)
        calls.clear()
        draws.clear()
        seeded = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=11)
        llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
        assert not calls, "a seeded request must keep the plain path (its noise is keyed by its own seed)"
        assert draws and all(shape[0] == 2 for shape in draws), "seeded rows draw one uniform number a row"
        calls.clear()
        schema = SamplingParams(temperature=0.8, max_tokens=6, structured_outputs={"choice": ["yes", "no"]})
        out = llm.generate(PROMPTS[:2], schema, use_tqdm=False)
        assert masked and not calls, "a temperature-only batch under grammars: masked and drawn in one call"
        assert all(o.outputs[0].text in ("yes", "no") for o in out)
    with LLM(checkpoint(), **options) as llm:  # the engine's seed fixes the draws
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], hot, use_tqdm=False)] == first
