"""The cpu platform's temperature sampler (nanoplug/kernels/cpu/sampling.py): its draws follow
softmax(logits / T) as the plain sampler's do, a -inf logit is never drawn, the same seed gives the same
tokens; and a CPU engine sends temperature-only batches to it, seeded requests still to the plain path."""
from __future__ import annotations

import torch

from _checkpoints import PROMPTS, checkpoint
from _sampling import check_temperature_sampler
from nanoplug import LLM, SamplingParams
from nanoplug.kernels.cpu import sampling


def test_draws_follow_softmax_of_logits_over_temperature():
    check_temperature_sampler(sampling.sample, rows=20000, slack=1e-4)


def test_each_row_has_its_own_temperature_and_never_draws_a_masked_token():
    vocab = 50000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, : vocab - 1] -= 100.0  # all the mass on the last token...
    logits[2, -1] = float("-inf")  # ...but in row 2, which must pick from the rest
    tokens = sampling.sample(logits, torch.tensor([1.0, 0.05, 1.0]), seed=7)
    assert tokens[:2].tolist() == [vocab - 1, vocab - 1]
    assert 0 <= tokens[2] < vocab - 1


def test_a_cpu_engine_samples_temperature_only_batches_through_it(monkeypatch):
    calls = []
    sample = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a: calls.append(a[0].shape) or sample(*a))
    options = dict(device="cpu", dtype="float32", attention="sdpa", kv_cache="torch", max_model_len=128, seed=3)
    with LLM(checkpoint(), **options) as llm:
        hot = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
        first = [o.token_ids for o in llm.generate(PROMPTS[:2], hot, use_tqdm=False)]
        assert calls and all(shape[0] == 2 for shape in calls)
        calls.clear()
        seeded = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=11)
        llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
        assert not calls, "a seeded request must keep the plain path (its noise is keyed by its own seed)"
    with LLM(checkpoint(), **options) as llm:  # the engine's seed fixes the draws
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], hot, use_tqdm=False)] == first
