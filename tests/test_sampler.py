"""The sampler: filtering math checked directly on logits, draws checked against their distribution,
and per-request seeds checked both on the sampler and through the engine."""
from __future__ import annotations

import math

import pytest
import torch

from _checkpoints import checkpoint, prompt_ids
from nanoplug import LLM, SamplingParams
from nanoplug.kernels.cpu import sampling
from nanoplug.worker.sampler import Sampler, SamplingBatch, _top_p_among_largest, _top_p_sorted


def batch(n: int = 1, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None) -> SamplingBatch:
    def per_row(value):
        return list(value) if isinstance(value, (list, tuple)) else [value] * n

    return SamplingBatch(per_row(temperature), per_row(top_k), per_row(top_p), per_row(min_p),
                         list(seeds) if seeds is not None else [None] * n,
                         list(positions) if positions is not None else list(range(n)))


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


# -------------------------------------------------------------------------- filtering math
def test_temperature_scales_logits_before_softmax():
    probs = Sampler.probabilities(LOGITS, batch(temperature=0.5))
    expected = softmax([v / 0.5 for v in LOGITS[0].tolist()])
    assert torch.allclose(probs[0], torch.tensor(expected), atol=1e-6)


def test_top_k_keeps_the_k_most_likely_tokens_renormalised():
    probs = Sampler.probabilities(LOGITS, batch(top_k=2))
    expected = softmax([2.0, 1.0])
    assert torch.allclose(probs[0], torch.tensor(expected + [0.0] * 4), atol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = softmax(LOGITS[0].tolist())  # ~[0.55, 0.20, 0.12, 0.07, 0.03, 0.004]
    p = full[0] + full[1] + 0.01  # the first two fall just short of p: a third token is needed
    probs = Sampler.probabilities(LOGITS, batch(top_p=p))
    kept = full[:3]
    assert torch.allclose(probs[0], torch.tensor([x / sum(kept) for x in kept] + [0.0] * 3), atol=1e-6)
    exactly = Sampler.probabilities(LOGITS, batch(top_p=full[0] + full[1]))  # reaching p exactly: two tokens
    assert (exactly[0] > 0).sum() == 2
    tiny = Sampler.probabilities(LOGITS, batch(top_p=0.01))  # the top token always stays
    assert tiny[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    full = softmax(LOGITS[0].tolist())
    min_p = 0.3  # keeps p >= 0.3 * p_max: e^(v - 2) >= 0.3, i.e. v >= 2 + ln 0.3 = 0.796
    probs = Sampler.probabilities(LOGITS, batch(min_p=min_p))
    kept = [x if x >= min_p * full[0] else 0.0 for x in full]
    assert [x > 0 for x in probs[0].tolist()] == [True, True, False, False, False, False]
    assert torch.allclose(probs[0] / probs[0].sum(), torch.tensor(kept) / sum(kept), atol=1e-6)


def test_filters_apply_per_row():
    logits = LOGITS.repeat(4, 1)
    probs = Sampler.probabilities(logits, batch(4, top_k=[0, 1, 3, 0], top_p=[1.0, 1.0, 1.0, 0.5]))
    assert [(row > 0).sum().item() for row in probs] == [6, 1, 3, 1]


def test_top_p_from_the_largest_logits_keeps_what_the_full_sort_keeps():
    """The host's top-p from the largest 256 or 2048 logits keeps exactly the full sort's tokens, row by row,
    and leaves a batch that the largest 2048 do not cover to the sort."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 32768, generator=gen) * torch.linspace(2, 12, 12).unsqueeze(1)  # flat to peaked
    top_ps = torch.tensor([0.5, 0.9, 0.95, 0.99, 0.3, 0.8] * 2)
    peaked = slice(6, 12)  # their mass is within the largest logits
    partial = _top_p_among_largest(logits[peaked], top_ps[peaked])
    assert partial is not None
    assert torch.equal(partial, _top_p_sorted(logits[peaked], top_ps[peaked]))
    beside = top_ps[peaked].clone()
    beside[::2] = 1.0  # unfiltered rows beside filtered ones: they keep every token, the others as before
    mixed = _top_p_among_largest(logits[peaked], beside)
    assert mixed is not None and torch.equal(mixed[::2], logits[peaked][::2])
    assert torch.equal(mixed[1::2], _top_p_sorted(logits[peaked][1::2], beside[1::2]))
    flat = logits[:2] * 0.01  # nearly uniform: the largest 2048 of 32768 tokens fall short of p
    assert _top_p_among_largest(flat, top_ps[:2]) is None
    logits[0] *= 0.01
    for rows in (peaked, slice(0, 12)):  # through the sampler: the largest logits, then the sort
        got = Sampler.probabilities(logits[rows], batch(6 if rows == peaked else 12, top_p=top_ps[rows].tolist()))
        assert torch.equal(got, torch.softmax(_top_p_sorted(logits[rows], top_ps[rows]), dim=-1))


# ------------------------------------------------------------------------------- drawing
DRAWS = {"exponential race": None, "inverse CDF": sampling.draw}  # the plain draw, the CPU platform's


@pytest.fixture(params=list(DRAWS))
def draw(request):
    return DRAWS[request.param]


def test_temperature_zero_is_greedy_even_beside_sampled_rows(draw):
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    temps = [0.0, 1.0] * 4
    tokens = Sampler(torch.device("cpu"), inverse_cdf=draw)(logits, batch(8, temperature=temps, top_k=20))
    greedy = logits.argmax(-1)
    assert all(tokens[i] == greedy[i] for i in range(0, 8, 2))
    assert torch.equal(Sampler(torch.device("cpu"), inverse_cdf=draw)(logits, batch(8, temperature=0.0)), greedy)


def test_draws_follow_the_filtered_distribution(draw):
    """4000 rows of the same logits: the token frequencies match the probabilities."""
    n = 4000
    sampler = Sampler(torch.device("cpu"), seed=1, inverse_cdf=draw)
    settings = batch(n, temperature=0.8, top_k=4)
    tokens = sampler(LOGITS.repeat(n, 1), settings)
    want = Sampler.probabilities(LOGITS, batch(1, temperature=0.8, top_k=4))[0]
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert freq[4:].sum() == 0  # filtered tokens are never drawn
    assert torch.allclose(freq, want, atol=4 * math.sqrt(0.25 / n))  # four standard errors


def test_same_seed_same_token_whatever_else_is_in_the_batch(draw):
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    sampler = Sampler(torch.device("cpu"), inverse_cdf=draw)
    alone = sampler(logits[2:3], batch(1, seeds=[42], positions=[17]))
    for order in ([2, 0, 1, 3, 4], [4, 3, 2], [0, 2]):
        rows = logits[order]
        seeds = [42 if i == 2 else None for i in order]
        positions = [17 if i == 2 else 5 for i in order]
        got = sampler(rows, batch(len(order), seeds=seeds, positions=positions))
        assert got[order.index(2)] == alone[0]
    other_position = [sampler(logits[2:3], batch(1, seeds=[42], positions=[p]))[0].item() for p in range(18, 40)]
    assert len(set(other_position)) > 1  # the noise moves on with the position


# ------------------------------------------------------------------------ through the engine
@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint(), kv_block_size=16, attention="sdpa", kv_cache="torch", num_kv_blocks=64, max_model_len=256)


def test_engine_seed_gives_the_same_tokens_alone_or_in_any_batch(llm):
    prompts = prompt_ids()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 12, 7)]
    mixed = llm.generate([prompts[0], prompts[1], prompts[2], prompts[3]],
                         [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert mixed[1].token_ids == alone
    assert [len(o.token_ids) for o in mixed] == [3, 10, 12, 7]
    again = llm.generate([prompts[3], prompts[1]], [others[1], seeded], use_tqdm=False)
    assert again[1].token_ids == alone
    different = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=10, ignore_eos=True)
    assert llm.generate([prompts[1]], different, use_tqdm=False)[0].token_ids != alone


def test_engine_top_k_one_is_greedy(llm):
    prompts = prompt_ids()
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]
