"""Penalties and logit bias: the math against transformers' own logits processors (repetition penalty,
sequence bias) and against OpenAI's formula written out plainly (presence, frequency); the device
token counts kept incrementally against counts rebuilt from the token lists; and the sampler's
default path, which must not enter any of it."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from nanoplug import SamplingParams
from nanoplug.errors import RequestError
from nanoplug.api import LogitsProcessingBatch, SlotInit
from nanoplug.engine.penalties import PenaltySlots, add_sample_row, check_token_ids
from nanoplug.worker.logits_processors import LogitsProcessors
from nanoplug.worker.sampler import Sampler, SamplingBatch

VOCAB = 40
CPU = torch.device("cpu")


def openai_penalties(logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's documented formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for j in range(out.shape[0]):
        c = output_ids.count(j)
        out[j] = out[j] - c * frequency - float(c > 0) * presence
    return out


def hf_repetition(logits: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    if not ids:
        return logits.clone()
    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits.unsqueeze(0).clone())[0]


def hf_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    if not bias:
        return logits.clone()
    processor = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()])
    return processor(torch.tensor([[0]]), logits.unsqueeze(0).clone())[0]


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """vLLM's order: bias, then repetition over prompt + output, then frequency and presence over the output."""
    out = hf_bias(logits, params.logit_bias)
    if params.repetition_penalty != 1.0:
        out = hf_repetition(out, prompt + output, params.repetition_penalty)
    return openai_penalties(out, output, params.presence_penalty, params.frequency_penalty)


class Rows:
    """A batch of sequences as the engine would present them: each penalized one with its slot."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], params: list[SamplingParams]):
        self.prompts, self.outputs, self.params = prompts, outputs, params
        self.slots = PenaltySlots()
        self.slot_of = [self.slots.take() if p.penalized else None for p in params]
        self.fresh = set(s for s in self.slot_of if s is not None)

    def batch(self) -> LogitsProcessingBatch:
        batch = LogitsProcessingBatch()
        for row, (p, slot) in enumerate(zip(self.params, self.slot_of)):
            if slot in self.fresh:
                batch.inits.append(SlotInit(slot, self.prompts[row], self.outputs[row]))
            add_sample_row(batch, row, p, slot)
        self.fresh = set()
        return batch


def random_case(rng: random.Random, num_rows: int):
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(num_rows)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 15))] for _ in range(num_rows)]
    params = []
    for i in range(num_rows):
        kind = i % 5
        params.append(SamplingParams(
            repetition_penalty=[1.0, 1.3, 0.7, 1.0, 2.0][kind],
            presence_penalty=[0.0, 0.0, 0.5, -1.5, 2.0][kind],
            frequency_penalty=[0.0, 0.0, 0.3, 1.1, -2.0][kind],
            logit_bias={} if kind in (0, 1) else {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(3)},
        ))
    logits = torch.randn(num_rows, VOCAB) * 3
    return logits, prompts, outputs, params


# -------------------------------------------------------------------------------- the math
@pytest.mark.parametrize("penalty", [1.0, 1.2, 0.8, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    rng = random.Random(0)
    logits, prompts, outputs, _ = random_case(rng, 6)
    params = [SamplingParams(repetition_penalty=penalty)] * 6
    rows = Rows(prompts, outputs, params)
    got = LogitsProcessors(CPU).apply(logits, rows.batch())
    for i in range(6):
        want = hf_repetition(logits[i], prompts[i] + outputs[i], penalty)
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (-2.0, 2.0), (1.5, -0.4)])
def test_presence_and_frequency_follow_the_openai_formula(presence, frequency):
    rng = random.Random(1)
    logits, prompts, outputs, _ = random_case(rng, 5)
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 5
    got = LogitsProcessors(CPU).apply(logits, Rows(prompts, outputs, params).batch())
    for i in range(5):  # the prompt's tokens play no part in these two
        torch.testing.assert_close(got[i], openai_penalties(logits[i], outputs[i], presence, frequency))


def test_logit_bias_equals_transformers_sequence_bias():
    logits = torch.randn(3, VOCAB)
    biases = [{3: 5.0, 7: -100.0}, {}, {0: 0.25, VOCAB - 1: 100.0, 12: -3.5}]
    params = [SamplingParams(logit_bias=b) for b in biases]
    got = LogitsProcessors(CPU).apply(logits, Rows([[1]] * 3, [[]] * 3, params).batch())
    for i in range(3):
        torch.testing.assert_close(got[i], hf_bias(logits[i], biases[i]), rtol=0, atol=0)


def test_everything_together_in_vllm_order_and_neutral_rows_untouched():
    rng = random.Random(2)
    logits, prompts, outputs, params = random_case(rng, 10)
    before = logits.clone()
    got = LogitsProcessors(CPU).apply(logits, Rows(prompts, outputs, params).batch())
    assert torch.equal(logits, before)  # the raw logits stay for logprobs and output_logits
    assert got.dtype == torch.float32
    for i in range(10):
        torch.testing.assert_close(got[i], reference(logits[i], prompts[i], outputs[i], params[i]))
    assert torch.equal(got[0], logits[0]) and torch.equal(got[5], logits[5])  # rows with nothing asked


def test_half_precision_logits_come_back_float32():
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams()]
    got = LogitsProcessors(CPU).apply(logits, Rows([[1, 2], [3]], [[4], []], params).batch())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[0], hf_repetition(logits[0].float(), [1, 2, 4], 1.5))
    assert torch.equal(got[1], logits[1].float())


# ---------------------------------------------------------------- counts kept on the device
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_incremental_counts_equal_counts_rebuilt_from_the_tokens(data):
    """Sequences come and go (slots reused, the state growing past its first size); after every step the
    device counts and prompt masks equal those rebuilt from each live sequence's token lists."""
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    processors, slots = LogitsProcessors(CPU), PenaltySlots()
    live: dict[int, tuple[list[int], list[int], SamplingParams]] = {}  # slot -> (prompt, output, params)
    fresh: set[int] = set()
    for _ in range(data.draw(st.integers(1, 12))):
        for _ in range(data.draw(st.integers(0, 4))):  # arrivals, some with output already (after preemption)
            slot = slots.take()
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
            output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4))]
            live[slot] = (prompt, output, SamplingParams(frequency_penalty=rng.choice([0.5, 0.0]),
                                                         repetition_penalty=rng.choice([1.3, 1.01])))
            fresh.add(slot)
        for slot in [s for s in live if rng.random() < 0.2 and s not in fresh]:  # departures
            del live[slot]
            slots.give_back(slot)
        if not live:
            continue
        order = list(live)
        rng.shuffle(order)
        batch = LogitsProcessingBatch(inits=[SlotInit(s, live[s][0], list(live[s][1])) for s in order if s in fresh])
        fresh.clear()
        for row, slot in enumerate(order):
            add_sample_row(batch, row, live[slot][2], slot)
        processors.apply(torch.randn(len(order), VOCAB), batch)
        tokens = torch.tensor([rng.randrange(VOCAB) for _ in order])
        processors.record(tokens, batch)
        for slot, token in zip(order, tokens.tolist()):
            live[slot][1].append(token)
        for slot, (prompt, output, _) in live.items():
            counts, mask = processors.slot_state(slot)
            assert counts.tolist() == [output.count(t) for t in range(VOCAB)]
            assert mask.tolist() == [t in prompt for t in range(VOCAB)]
    assert slots.in_use == len(live)


def test_slots_are_reused_lowest_first():
    slots = PenaltySlots()
    assert [slots.take() for _ in range(4)] == [0, 1, 2, 3]
    slots.give_back(2)
    slots.give_back(0)
    assert [slots.take(), slots.take(), slots.take()] == [0, 2, 4]


# ----------------------------------------------------------------------------- the sampler
def sampling(n: int, temperature=0.0, seeds=None, processing=None) -> SamplingBatch:
    return SamplingBatch([temperature] * n, [0] * n, [1.0] * n, [0.0] * n, seeds or [None] * n, list(range(n)),
                         processing=processing)


def test_a_batch_without_penalties_or_bias_never_enters_the_processors(monkeypatch):
    def refuse(*args):
        raise AssertionError("the default path must not process logits")

    monkeypatch.setattr(LogitsProcessors, "apply", refuse)
    monkeypatch.setattr(LogitsProcessors, "record", refuse)
    sampler = Sampler(CPU)
    logits = torch.randn(4, VOCAB)
    assert torch.equal(sampler(logits, sampling(4)), logits.argmax(-1))
    sampler(logits, sampling(4, temperature=0.8))
    assert sampler.processors.counts is None  # no device state either


def test_greedy_and_seeded_draws_use_the_processed_logits():
    rng = random.Random(3)
    logits, prompts, outputs, params = random_case(rng, 10)
    want = torch.stack([reference(logits[i], prompts[i], outputs[i], params[i]) for i in range(10)])
    greedy = Sampler(CPU)(logits, sampling(10, processing=Rows(prompts, outputs, params).batch()))
    assert torch.equal(greedy, want.argmax(-1))
    seeds = list(range(100, 110))
    drawn = Sampler(CPU)(logits, sampling(10, 0.9, seeds, Rows(prompts, outputs, params).batch()))
    assert torch.equal(drawn, Sampler(CPU)(want, sampling(10, 0.9, seeds)))


def test_the_sampler_counts_its_own_tokens_for_the_next_step():
    """A strong frequency penalty under greedy: a token once sampled loses to the next best one."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    rows = Rows([[3]], [[]], [SamplingParams(frequency_penalty=2.0)])
    sampler = Sampler(CPU)
    got = [sampler(logits, sampling(1, processing=rows.batch())).item() for _ in range(4)]
    # logits after the penalty: [5,4,3,0] -> 0 | [3,4,3,0] -> 1 | [3,2,3,0] -> 0 (first of a tie) | [1,2,3,0] -> 2
    assert got == [0, 1, 0, 2]
    counts, mask = sampler.processors.slot_state(rows.slot_of[0])
    assert counts.tolist() == [2, 1, 1, 0] and mask.tolist() == [False, False, False, True]


# ------------------------------------------------------------------------------ validation
def test_logit_bias_outside_the_vocabulary_is_a_request_error():
    check_token_ids(SamplingParams(logit_bias={VOCAB - 1: 1.0}), VOCAB)
    with pytest.raises(RequestError, match=rf"logit_bias for token id {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"):
        check_token_ids(SamplingParams(logit_bias={VOCAB: 1.0, 3: 2.0}), VOCAB, "prompt 2")


def test_params_say_whether_they_process_logits():
    assert not SamplingParams().processes_logits and not SamplingParams(temperature=0.3, n=4, logprobs=3).processes_logits
    assert SamplingParams(repetition_penalty=1.1).penalized
    assert SamplingParams(presence_penalty=-0.1).penalized and SamplingParams(frequency_penalty=0.1).penalized
    biased = SamplingParams(logit_bias={"7": 2})  # JSON's string keys become token ids
    assert biased.processes_logits and not biased.penalized and biased.logit_bias == {7: 2.0}
    assert SamplingParams(logprobs=0).needs_sampler_extras and biased.needs_sampler_extras
    assert not SamplingParams(n=3, seed=2).needs_sampler_extras
    plain = SamplingParams()
    assert not plain.processes_logits  # cached now: a copy with other fields must work its flags out again
    copy = plain.model_copy(update={"repetition_penalty": 1.2})
    assert copy.penalized and copy.processes_logits and copy.needs_sampler_extras and not plain.penalized
