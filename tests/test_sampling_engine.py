"""logprobs, n, penalties and logit bias through LLM.generate/stream, against transformers on the same
tiny checkpoint: logprobs equal log-softmax of its logits, penalized greedy tokens equal its `generate`
with the same logits processors, and the n samples of a prompt share its prefill and its blocks yet
equal the same samples run one by one."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from _checkpoints import PROMPTS, checkpoint, hf_logits, hf_model, prompt_ids, tokenizer
from _engine_checks import assert_idle
from nanoplug import LLM, SamplingParams
from nanoplug.errors import RequestError
from nanoplug.worker.logits_processors import LogitsProcessors

BLOCK = 16
OPTIONS = dict(kv_block_size=BLOCK, attention="sdpa", kv_cache="torch", num_kv_blocks=64, max_model_len=256)
STORY = ("In the quiet village of Alder Creek, the baker rose before dawn each morning to light the ovens, knead "
         "the dough and shape the loaves that the whole valley would eat by noon.")


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint(), **OPTIONS)


@pytest.fixture(scope="module")
def overlapped():
    return LLM(checkpoint(), **OPTIONS, overlap_steps=True)


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token at every position of `ids`: [len(ids), vocab]."""
    return torch.log_softmax(hf_logits("qwen3", ids).double(), dim=-1)


def assert_logprobs_match(entries, ids: list[int], first: int, k: int) -> None:
    """entries[i] scores ids[first + i] given ids[:first + i]."""
    want = hf_logprobs(ids)
    for i, lp in enumerate(entries):
        pos = first + i
        row = want[pos - 1]
        assert lp.token_id == ids[pos]
        assert lp.logprob == pytest.approx(row[ids[pos]].item(), abs=2e-4)
        value = row[ids[pos]]  # the rank, up to tokens within float32 noise of it (a random model's are many)
        assert int((row >= value + 2e-4).sum()) <= lp.rank <= int((row >= value - 2e-4).sum())
        top = row.topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=2e-4)


# ---------------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=1.3, top_k=40, seed=3, max_tokens=8, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, seed=4, max_tokens=8, ignore_eos=True, logprobs=0, repetition_penalty=1.5),
], ids=["greedy", "sampled", "penalized"])
def test_logprobs_equal_log_softmax_of_transformers_logits(llm, params):
    """Raw logprobs: whatever temperature, top-k or penalties did to the draw, they are the model's own."""
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for ids, out in zip(prompt_ids(), outs):
        assert len(out.logprobs) == len(out.token_ids) == 8
        assert_logprobs_match(out.logprobs, ids + out.token_ids, len(ids), params.logprobs)
        if params.temperature == 0:
            assert all(lp.rank == 1 for lp in out.logprobs)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].logprobs is None


def test_prompt_logprobs_equal_transformers_in_chunks_and_never_from_the_cache():
    with LLM(checkpoint(), **dict(OPTIONS, max_num_batched_tokens=7)) as small_chunks:  # chunks of 7 tokens
        ids = prompt_ids()[2]
        params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4, logprobs=1)
        first = small_chunks.generate([ids], params, use_tqdm=False)[0]
        assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(ids)
        assert_logprobs_match(first.prompt_logprobs[1:], ids, 1, 4)
        again = small_chunks.generate([ids], params, use_tqdm=False)[0]  # its blocks are cached now
        assert again.num_cached_tokens == 0
        assert [(lp.token_id, lp.logprob) for lp in again.prompt_logprobs[1:]] == \
               [(lp.token_id, lp.logprob) for lp in first.prompt_logprobs[1:]]
        plain = small_chunks.generate([ids], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None and plain.token_ids == first.token_ids
        assert_idle(small_chunks)


def test_stream_deltas_carry_the_logprobs_of_their_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    (out,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    deltas = list(llm.stream(PROMPTS[1], params))
    assert [lp for d in deltas for lp in d.logprobs] == out.logprobs
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)


# ----------------------------------------------------------------------------------- penalties
class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence/frequency formula over the generated tokens, written plainly for transformers."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token in set(input_ids[0, self.prompt_len:].tolist()):
            count = int((input_ids[0, self.prompt_len:] == token).sum())
            scores[0, token] -= count * self.frequency + self.presence
        return scores


@torch.no_grad()
def hf_generate(ids: list[int], params: SamplingParams, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with the penalties and bias as its logits processors, in vLLM's order."""
    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], v] for t, v in params.logit_bias.items()]))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(len(ids), params.presence_penalty, params.frequency_penalty))
    out = hf_model().generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                              logits_processor=processors)
    return out[0, len(ids):].tolist()


PENALIZED = [
    dict(repetition_penalty=2.0),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0, frequency_penalty=-0.5),
    dict(logit_bias={198: 8.0, 11: -100.0, 13: 5.0}),
    dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.8, logit_bias={198: 3.0}),
]


@pytest.mark.parametrize("fields", PENALIZED, ids=lambda f: ",".join(f))
def test_penalized_greedy_equals_transformers_with_the_same_processors(llm, overlapped, fields):
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **fields)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    want = [hf_generate(ids, params, 14) for ids in prompt_ids()]
    assert [o.token_ids for o in outs] == want
    assert [o.token_ids for o in plain] != want  # the processors changed something
    assert [o.token_ids for o in overlapped.generate(PROMPTS, params, use_tqdm=False)] == want
    assert llm.engine.scheduler.penalty_slots.in_use == 0
    assert_idle(llm)


def test_penalized_and_plain_requests_in_one_batch_keep_their_own_tokens(llm):
    """Mixed batches: each request gets what it gets alone (slots are per sequence, rows are not mixed up)."""
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [plain, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=2.0), plain,
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.8, logit_bias={13: 4})]
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(PROMPTS, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_penalized_requests_keep_their_counts_and_slots_are_reused(overlap):
    """Two at a time in a cache too small for both: preemption keeps a sequence's counts, and a finished
    sequence's slot serves the next one (under overlapped steps too, where a step ran ahead into it)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.2)
    with LLM(checkpoint(), **dict(OPTIONS, num_kv_blocks=4, max_model_len=64, max_num_seqs=2,
                                  overlap_steps=overlap)) as tight:
        outs = tight.generate(PROMPTS, params, use_tqdm=False)
        scheduler = tight.engine.scheduler
        assert scheduler.num_preemptions > 0
        assert scheduler.penalty_slots.size == 2 and scheduler.penalty_slots.in_use == 0
        assert_idle(tight)
    assert [o.token_ids for o in outs] == [hf_generate(ids, params, 24) for ids in prompt_ids()]


def test_defaults_never_touch_the_logits_processors(llm, monkeypatch):
    def refuse(*args):
        raise AssertionError("a batch without penalties or bias must take the plain sampler path")

    monkeypatch.setattr(LogitsProcessors, "apply", refuse)
    monkeypatch.setattr(LogitsProcessors, "record", refuse)
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=4), SamplingParams(seed=1, max_tokens=4),
                                  SamplingParams(n=2, max_tokens=4, logprobs=2), SamplingParams(max_tokens=4)],
                        use_tqdm=False)
    assert len(outs) == 4


def test_a_logit_bias_outside_the_vocabulary_is_refused_and_the_engine_serves_on(llm):
    vocab = llm.engine.facts.vocab_size
    with pytest.raises(RequestError, match=rf"prompt 1 has logit_bias for token id {vocab}, outside the vocabulary"):
        llm.generate(PROMPTS[:2], [SamplingParams(), SamplingParams(logit_bias={vocab: 1.0})], use_tqdm=False)
    assert_idle(llm)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 1.0}), use_tqdm=False)


# ------------------------------------------------------------------------------------------ n
def separately(llm: LLM, prompt, params: SamplingParams) -> list[list[int]]:
    """The n samples as n requests of their own: sample i with seed + i."""
    return [llm.generate([prompt], params.model_copy(update={"n": 1, "seed": params.seed + i}), use_tqdm=False)[0]
            .token_ids for i in range(params.n)]


def story(n_tokens: int, offset: int = 0) -> list[int]:
    return tokenizer().encode(STORY)[offset:offset + n_tokens]


def start(llm: LLM, ids: list[int], params: SamplingParams):
    """Add one request to the engine core, to step it by hand; returns the core, the request id and the
    tokens of each sample, which `finish` fills in."""
    core = llm.engine
    request = core.make_request(ids, params)
    core.add_request(request)
    return core, request.request_id, {}


def step(core, tokens: dict[int, list[int]]) -> None:
    for u in core.step():
        tokens.setdefault(u.index, []).extend(u.token_ids)


def finish(core, tokens: dict[int, list[int]]) -> list[list[int]]:
    while core.has_unfinished():
        step(core, tokens)
    return [tokens[i] for i in sorted(tokens)]


@pytest.mark.parametrize("length", [BLOCK + 3, 2 * BLOCK], ids=["partial-last-block", "whole-blocks"])
def test_n_samples_share_one_prefill_and_the_prompt_blocks(llm, length):
    """Step by step: one prefill step computes the prompt once; right after it the full prompt blocks have
    one reference per sample and the partial last block is each sample's own; the samples then equal
    the same seeds run one by one (so the copied block held the right K/V)."""
    ids = story(length, offset=length % 7)  # no block of one case is in the cache from the other
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    core, request_id, tokens = start(llm, ids, params)
    blocks = core.scheduler.blocks
    free_before = blocks.num_free_blocks
    step(core, tokens)
    assert core.last_step == (True, length, 1)  # one prefill of the prompt, not four
    root = core.requests[request_id].seq
    samples = root.samples
    assert [s.sample_index for s in samples] == [0, 1, 2, 3]
    full = length // BLOCK
    shared = root.block_table[:full]
    assert all(s.block_table[:full] == shared for s in samples)
    assert all(blocks.ref_counts[b] == 4 for b in shared)
    own = [s.block_table[full] for s in samples if len(s.block_table) > full]
    assert len(set(own)) == len(own) == (4 if length % BLOCK else 0)
    assert free_before - blocks.num_free_blocks == full + len(own)
    assert all(s.num_completion_tokens == 1 and s.num_cached_tokens == 0 for s in samples)
    assert sorted(tokens) == [0, 1, 2, 3] and all(len(t) == 1 for t in tokens.values())
    got = finish(core, tokens)
    assert got == separately(llm, ids, params)
    assert len({tuple(t) for t in got}) > 1  # the samples differ
    out = llm.generate([ids], params, use_tqdm=False)[0]  # the same through generate
    assert [o.index for o in out.outputs] == [0, 1, 2, 3] and [o.token_ids for o in out.outputs] == got
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    assert_idle(llm)


def test_n_is_reproducible_with_a_seed_and_works_beside_other_requests(llm, overlapped):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=5, max_tokens=8, ignore_eos=True, logprobs=1)
    others = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate(PROMPTS, [others, params, others, params], use_tqdm=False)
    again = overlapped.generate(PROMPTS, [others, params, others, params], use_tqdm=False)
    for a, b in zip(first, again):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
    assert [len(o.outputs) for o in first] == [1, 3, 1, 3]
    assert [o.token_ids for o in first[3].outputs] == separately(llm, PROMPTS[3], params)
    for sample in first[1].outputs:  # each sample has its own logprobs, against transformers
        assert_logprobs_match(sample.logprobs, prompt_ids()[1] + sample.token_ids, len(prompt_ids()[1]), 1)
    greedy = llm.generate(PROMPTS[2], SamplingParams(n=3, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    assert_idle(llm)
    assert_idle(overlapped)


def test_n_with_penalties_stops_and_a_stream(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True, frequency_penalty=1.0)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == separately(llm, PROMPTS[0], params)
    stop = out.outputs[1].text[3:6]
    stopped = llm.generate(PROMPTS[0], params.model_copy(update={"stop": [stop]}), use_tqdm=False)[0]
    assert stopped.outputs[1].finish_reason == "stop" and stopped.outputs[1].text == out.outputs[1].text[:3]
    deltas = list(llm.stream(PROMPTS[0], params))
    for i, sample in enumerate(out.outputs):
        mine = [d for d in deltas if d.index == i]
        assert [t for d in mine for t in d.token_ids] == sample.token_ids
        assert "".join(d.text for d in mine) == sample.text
        assert [d.finished for d in mine][-1] and not any(d.finished for d in mine[:-1])
    assert_idle(llm)


def test_n_samples_that_find_no_room_wait_and_still_draw_the_same_tokens():
    """max_num_seqs 2 and a small cache: some samples fork later as plain prompts, some are preempted."""
    params = SamplingParams(n=5, temperature=1.0, seed=8, max_tokens=20, ignore_eos=True)
    ids = story(BLOCK + 5)
    with LLM(checkpoint(), **OPTIONS) as roomy:
        want = separately(roomy, ids, params)
    with LLM(checkpoint(), **dict(OPTIONS, max_num_seqs=2, num_kv_blocks=7, max_model_len=64)) as tight:
        out = tight.generate([ids], params, use_tqdm=False)[0]
        assert [o.token_ids for o in out.outputs] == want
        assert_idle(tight)


def test_a_prompt_whose_last_token_comes_in_a_decode_step_still_forks():
    """Chunks of 8 leave the last of 17 prompt tokens to a decode step: the samples fork there."""
    with LLM(checkpoint(), **dict(OPTIONS, max_num_batched_tokens=8)) as chunked:
        ids = prompt_ids()[1]
        assert len(ids) == 17
        params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=6, ignore_eos=True)
        core, request_id, tokens = start(chunked, ids, params)
        steps = []
        while len(tokens) < 3:
            step(core, tokens)
            steps.append(core.last_step)
        assert steps == [(True, 8, 1), (True, 8, 1), (False, 1, 1)]
        assert finish(core, tokens) == separately(chunked, ids, params)
        assert_idle(chunked)


def test_engine_core_updates_of_n_samples_and_their_abort(llm):
    """Each update extends one sample (index); finished marks the request's end (its last update), a sample's
    own end its finish_reason; prompt logprobs come once. An abort ends every sample and frees their blocks."""
    core = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    request = core.make_request(PROMPTS[1], params)
    core.add_request(request)
    updates = []
    while core.has_unfinished():
        updates += core.step()
    assert {u.request_id for u in updates} == {request.request_id}
    assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]
    for i in range(3):
        mine = [u for u in updates if u.index == i]
        assert sum(len(u.token_ids) for u in mine) == 5 and all(len(u.logprobs) == len(u.token_ids) for u in mine)
        assert [u.finish_reason for u in mine] == [None] * (len(mine) - 1) + ["length"]
    with_prompt = [u for u in updates if u.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0
    assert len(with_prompt[0].prompt_logprobs) == len(prompt_ids()[1])
    assert request.request_id not in core.requests

    long = params.model_copy(update={"max_tokens": 50})
    request = core.make_request(PROMPTS[2], long)
    core.add_request(request)
    core.step()  # the prompt's prefill, and the fork
    assert len(core.requests[request.request_id].samples) == 3
    core.step()
    core.abort(request.request_id)
    last = [u for u in core.step() if u.request_id == request.request_id]
    assert sorted(u.index for u in last) == [0, 1, 2]
    assert all(u.finish_reason == "abort" and u.finished for u in last)
    while core.has_unfinished():
        core.step()
    assert_idle(llm)
