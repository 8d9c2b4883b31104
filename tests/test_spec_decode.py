"""Speculative decoding (kind `speculator`): whatever the drafts, the output is the target's. Greedy outputs
equal the non-speculative engine's token for token (texts, finish reasons, logprobs), with prefix caching,
preemption, stop strings and ids, max_tokens and max_model_len reached mid-draft; drafts are really accepted
and rejected (an oracle speculator, registered as a third party, proposes the right tokens, or the right ones
with one wrong); no KV block is left behind."""
from __future__ import annotations

import numpy as np
import pytest

from _checkpoints import PROMPTS, checkpoint
from _engine_checks import assert_idle
from _test_platforms import registry_with_plugin
from nanoplug import LLM, SamplingParams
from nanoplug.api import Speculator
from nanoplug.engine.registry import Registry
from nanoplug.plugins.speculators.ngram import lookup

OPTIONS = dict(kv_block_size=16, attention="sdpa", kv_cache="torch", num_kv_blocks=64, max_model_len=72)
# prompts that repeat themselves, so prompt lookup finds drafts (a random model rejects most of them)
REPEATING = [[5, 6, 7, 8, 9] * 4 + [5, 6], [100, 200, 300] * 5 + [100], list(range(40, 60)) + list(range(40, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def registry_with(name: str, cls: type) -> Registry:
    return registry_with_plugin("speculator", name, cls)


def oracle(reference: dict[tuple[int, ...], list[int]]) -> type:
    """A speculator that knows the greedy continuation of each prompt: every draft is right, or, with
    `wrong_at` set on it, the draft at that place of each proposal is wrong (the tokens after it are thrown away)."""

    class Oracle(Speculator):
        description = "test: proposes the known continuation"
        wrong_at: int | None = None

        def propose(self, token_ids, num_drafts):
            out = []
            for ids, k in zip(token_ids, num_drafts):
                drafts = []
                for prompt, continuation in reference.items():
                    if tuple(ids[:len(prompt)]) == prompt:
                        done = len(ids) - len(prompt)
                        drafts = list(continuation[done:done + k])
                        break
                if self.wrong_at is not None and len(drafts) > self.wrong_at:
                    drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 1000
                out.append(drafts)
            return out

    return Oracle


@pytest.fixture(scope="module")
def plain():
    return LLM(checkpoint(), **OPTIONS)


@pytest.fixture(scope="module")
def reference(plain):
    """Each prompt's greedy continuation (longer than any test asks for)."""
    prompts = [plain.engine.make_request(p).prompt_token_ids for p in PROMPTS] + REPEATING
    outs = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def oracle_llm(reference):
    return spec_engine("oracle", registry_with("oracle", oracle(reference)))


def spec_engine(speculator: str, registry: Registry | None = None, **options) -> LLM:
    return LLM(checkpoint(), registry=registry, speculator=speculator, num_speculative_tokens=4,
               **{"adaptive_speculation": False, **OPTIONS, **options})


def assert_same(want, got) -> None:
    for a, b in zip(want, got, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        if a.logprobs is not None:
            assert [(t.token_id, t.rank) for t in a.logprobs] == [(t.token_id, t.rank) for t in b.logprobs]
            np.testing.assert_allclose([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs], atol=1e-4)


def test_ngram_lookup_matches_a_plain_search():
    """The numpy search against the obvious one: the longest suffix of min..max tokens seen before, its most
    recent occurrence, the tokens after it."""
    rng = np.random.default_rng(0)

    def plain_search(tokens, k, min_n, max_n):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            suffix = list(tokens[-n:])
            for start in range(len(tokens) - n - 1, -1, -1):
                if list(tokens[start:start + n]) == suffix:
                    return list(tokens[start + n:start + n + k])
        return []

    for _ in range(400):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30)))
        k, min_n = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        assert lookup(tokens, k, min_n, max_n).tolist() == plain_search(tokens, k, min_n, max_n)


def test_bad_speculator_choices_name_the_fix():
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        spec_engine("ngram", speculator_options={"lookahead": 3})
    with pytest.raises(Exception, match="valid names: draft, eagle, ngram"):
        spec_engine("nope")


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_greedy_equals_plain_with_accepted_and_rejected_drafts(plain, reference, oracle_llm, wrong_at):
    llm = oracle_llm
    llm.engine.speculation.speculator.wrong_at = wrong_at
    llm.engine.speculation.stats = type(llm.engine.speculation.stats)()
    prompts = list(reference)
    assert_same(plain.generate(prompts, GREEDY, use_tqdm=False), llm.generate(prompts, GREEDY, use_tqdm=False))
    stats = llm.engine.speculation.stats
    assert stats.verifications > 0
    if wrong_at is None:  # every draft is the target's token
        assert stats.accepted_tokens == stats.draft_tokens > 0
    else:  # each proposal keeps exactly the drafts before the wrong one (all of a short one at a request's end)
        assert wrong_at * (stats.verifications - len(prompts)) <= stats.accepted_tokens
        assert stats.accepted_tokens <= wrong_at * stats.verifications
    assert_idle(llm)


def test_greedy_equals_plain_with_stops_lengths_and_prefix_hits(plain, reference, oracle_llm):
    """Stop strings and ids, max_tokens and max_model_len reached inside a run of drafts; the same prompts
    twice (the second time from the prefix cache)."""
    llm = oracle_llm
    llm.engine.speculation.speculator.wrong_at = None
    prompts = list(reference)
    conts = list(reference.values())
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),  # ends inside the first proposal
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[conts[1][6]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=[plain.engine.tokenizer.decode(conts[2][5:7])],
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),  # max_model_len
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5),
        GREEDY,
    ]
    for _ in range(2):
        want, got = plain.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)
        assert_same(want, got)
    assert any(o.num_cached_tokens > 0 for o in got) and len(got[0].token_ids) == 3
    assert got[4].finish_reason == "length" and len(got[4].prompt_token_ids) + len(got[4].token_ids) == 72
    assert_idle(llm)


def test_seeded_requests_repeat_under_speculation(oracle_llm, reference):
    llm, prompts = oracle_llm, list(reference)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=12, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    first, again = llm.generate(prompts, params, use_tqdm=False), llm.generate(prompts[::-1], params[::-1],
                                                                              use_tqdm=False)[::-1]
    assert_same(first, again)


def test_greedy_ngram_equals_plain(plain):
    llm = spec_engine("ngram", speculator_options={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert "speculator: asked 'ngram', chose 'ngram'" in llm.engine.describe_plugins()[-1]
    assert (llm.engine.speculation.speculator.min_n, llm.engine.speculation.speculator.max_n) == (1, 3)
    want = plain.generate(REPEATING + PROMPTS, GREEDY, use_tqdm=False)
    assert_same(want, llm.generate(REPEATING + PROMPTS, GREEDY, use_tqdm=False))
    assert llm.engine.speculation.stats.draft_tokens > 0
    assert_idle(llm)


@pytest.mark.slow
def test_preemption_under_speculation(reference):
    """A cache too small for every request: sequences are preempted, their lookahead blocks with them."""
    options = dict(num_kv_blocks=9, max_model_len=144, max_num_batched_tokens=20)
    plain, llm = LLM(checkpoint(), **{**OPTIONS, **options}), spec_engine(
        "oracle", registry_with("oracle", oracle(reference)), **options)
    llm.engine.speculation.speculator.wrong_at = 3
    prompts = list(reference) * 2
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert_same(plain.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.speculation.stats.accepted_tokens > 0
    assert_idle(llm)


def chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """The p-value of Pearson's chi-square test that two count vectors come from one distribution."""
    import torch

    keep = (a + b) > 0
    table = np.stack([a[keep], b[keep]]).astype(np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = keep.sum() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def small_vocab():
    """A plain engine and one with an oracle speculator on a 512-token model, and the greedy continuation the
    oracle drafts (the target's most likely tokens, so drafts are often but not always kept)."""
    options = dict(OPTIONS, num_kv_blocks=640)  # room for 200 sequences and their lookahead
    plain = LLM(checkpoint("qwen3_vocab512"), **options)
    out = plain.generate([SMALL_PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    reference = {tuple(SMALL_PROMPT): out[0].token_ids}
    llm = LLM(checkpoint("qwen3_vocab512"), registry=registry_with("oracle", oracle(reference)), speculator="oracle",
              num_speculative_tokens=4, adaptive_speculation=False, **options)
    return plain, llm, reference


SMALL_PROMPT = [5, 6, 7, 8, 9] * 3


@pytest.mark.slow
@pytest.mark.parametrize("filters", [dict(temperature=1.0, top_k=3), dict(temperature=0.06, top_p=0.9, min_p=0.05)])
def test_rejection_sampling_keeps_the_target_distribution(small_vocab, filters):
    """On a fixed context, the first three tokens sampled with drafts (kept about as often as the target gives
    them) are distributed as without drafts: a chi-square test on their joint frequencies, every request
    seeded (so the test is deterministic). A sampler that kept every draft fails it (p ~ 0)."""
    plain, llm, reference = small_vocab
    llm.engine.speculation.stats = type(llm.engine.speculation.stats)()
    n, batch = 1200, 200  # batches below max_num_seqs: a step speculates only when no prompt waits
    params = {**filters, "max_tokens": 3, "ignore_eos": True}

    def counts(engine: LLM, first_seed: int) -> dict[tuple[int, ...], int]:
        found: dict[tuple[int, ...], int] = {}
        for at in range(first_seed, first_seed + n, batch):
            outs = engine.generate([SMALL_PROMPT] * batch, [SamplingParams(seed=s, **params)
                                                            for s in range(at, at + batch)], use_tqdm=False)
            for o in outs:
                found[tuple(o.token_ids)] = found.get(tuple(o.token_ids), 0) + 1
        return found

    want, got = counts(plain, n), counts(llm, 0)
    stats = llm.engine.speculation.stats
    assert stats.verifications >= n and 0 < stats.accepted_tokens < stats.draft_tokens  # drafts kept and thrown away
    keys = sorted(set(want) | set(got))
    a, b = np.array([want.get(k, 0) for k in keys]), np.array([got.get(k, 0) for k in keys])
    assert chi_square_p(a, b) > 1e-3, (keys, a, b)
    greedy = tuple(reference[tuple(SMALL_PROMPT)][:3])  # what keeping every draft would give, every time
    assert chi_square_p(a, np.array([n if k == greedy else 0 for k in keys])) < 1e-6


def test_metrics_report_acceptance_and_mean_accepted_length(oracle_llm, reference):
    from nanoplug.server.metrics import Metrics

    llm = oracle_llm
    llm.engine.speculation.speculator.wrong_at = 1
    llm.engine.speculation.stats = type(llm.engine.speculation.stats)()
    llm.generate(list(reference)[:2], GREEDY, use_tqdm=False)
    s = llm.engine.stats()
    assert s.spec_verifications > 0 and 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    text = Metrics(llm.engine.stats, lambda: 0).render().decode()
    rate, length = s.spec_accepted_tokens / s.spec_draft_tokens, 1 + s.spec_accepted_tokens / s.spec_verifications
    assert f"nanoplug_spec_decode_num_draft_tokens_total {float(s.spec_draft_tokens)}" in text
    assert f"nanoplug_spec_decode_acceptance_rate {rate}" in text
    assert f"nanoplug_spec_decode_mean_accepted_length {length}" in text
    assert length <= 2.0  # one draft kept at most (the second of each proposal is wrong), plus the target's token


def test_adaptive_k_takes_the_k_that_measured_fastest_per_batch_size():
    """Steps as a memory-bound batch 1 and a compute-bound batch 64 would time them: a step costs 1 ms plus
    0.1 ms a row and gives each sequence 1 + 0.75 + 0.75^2 + ... of its k drafts (75% kept)."""
    from nanoplug.engine.speculation import AdaptiveK

    def step(policy, num_seqs, accept=0.75):
        k = policy.choose(num_seqs)
        tokens = num_seqs * sum(accept ** i for i in range(k + 1))
        policy.observe(num_seqs, k, tokens, 1e-3 + 1e-4 * num_seqs * (k + 1))
        return k

    policy = AdaptiveK(4, explore_every=32)
    tried = [step(policy, 64) for _ in range(5 * 3)]
    assert tried == [4] * 3 + [3] * 3 + [2] * 3 + [1] * 3 + [0] * 3  # each k a few times, the widest first
    chosen = [step(policy, 64) for _ in range(200)]
    assert chosen.count(0) >= 190 and set(chosen) <= {0, 1}  # compute-bound: off, a neighbour now and then
    assert [step(policy, 1) for _ in range(15)][-1] == 0 and step(policy, 1) == 4  # batch 1 is its own: wide pays
    for _ in range(200):  # the drafts stop being kept: the wide steps fall behind, and speculation goes off
        step(policy, 1, accept=0.0)
    assert [policy.choose(1) for _ in range(32)].count(0) == 31  # and one neighbour (k = 1) again
    assert AdaptiveK.bucket(1) == 1 and AdaptiveK.bucket(63) == AdaptiveK.bucket(64) == 64 and AdaptiveK.bucket(65) == 128

    # a neighbour that measured far behind (here 10x slower: an eager verification) is tried 8x less often
    slow = AdaptiveK(4, explore_every=4)
    for _ in range(5 * 3 + 256):
        k = slow.choose(64)
        slow.observe(64, k, 64 * (1 + k), 1e-3 if k == 0 else 2e-2 * (k + 1))
    assert [slow.choose(64) for _ in range(64)].count(0) == 62  # 2 tries in 64 steps, not 16

    # where wide steps pay, plain steps are still measured afresh now and then (the baseline a choice is judged by)
    wide = AdaptiveK(4, explore_every=4)
    chosen = [step(wide, 1, accept=0.8) for _ in range(5 * 3 + 64)][15:]
    assert chosen.count(4) >= 48 and 0 < chosen.count(0) <= 4 and chosen.count(3) > 0


@pytest.mark.slow
def test_the_model_drafting_for_itself_keeps_every_draft(plain, reference):
    """`draft` with the target's own checkpoint: every draft is the target's greedy token (a bound on the
    verifier: a draft it throws away here would be its bug)."""
    llm = spec_engine("draft", speculator_options={"model": checkpoint(), "attention": "sdpa", "num_kv_blocks": 128})
    prompts = list(reference)
    assert_same(plain.generate(prompts, GREEDY, use_tqdm=False), llm.generate(prompts, GREEDY, use_tqdm=False))
    stats = llm.engine.speculation.stats
    assert stats.accepted_tokens == stats.draft_tokens > 0
    assert_idle(llm)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        spec_engine("draft", speculator_options={"model": checkpoint("qwen3_vocab512")})
