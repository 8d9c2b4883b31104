"""Logprobs: the device math against log-softmax written out plainly and against transformers'
`compute_transition_scores` on its own model's logits; the sampler reads them from the raw logits,
whatever temperature, penalties or bias did to the draw."""
from __future__ import annotations

import pytest
import torch

from _checkpoints import hf_model, prompt_ids
from nanoplug import SamplingParams
from nanoplug.worker import logprobs
from nanoplug.api import LogitsProcessingBatch, LogprobsTensors, SlotInit
from nanoplug.engine.penalties import add_sample_row
from nanoplug.worker.sampler import Sampler, SamplingBatch

CPU = torch.device("cpu")


def plain(logits_row: torch.Tensor, token: int, k: int) -> logprobs.TokenLogprobs:
    """The definition: log p = logit - log(sum(exp(logits))), in float64; rank counts tokens at least as likely."""
    row = logits_row.double()
    lp = row - torch.logsumexp(row, dim=0)
    order = sorted(range(len(lp)), key=lambda t: -lp[t].item())[:k]
    rank = int((lp >= lp[token]).sum())
    return logprobs.TokenLogprobs(token, lp[token].item(), rank, [(t, lp[t].item()) for t in order])


def assert_same(got: list[logprobs.TokenLogprobs], want: list[logprobs.TokenLogprobs], atol=1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.token_id, g.rank) == (w.token_id, w.rank)
        assert g.logprob == pytest.approx(w.logprob, abs=atol)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=atol)


def test_compute_equals_the_definition_with_per_row_alternatives():
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 4
    tokens = [int(logits[0].argmax()), 5, 17, 299, 0, int(logits[5].argmin())]
    num_top = [0, 1, 5, 20, 3, 2]
    got = logprobs.token_logprobs(logprobs.compute(logits, torch.tensor(tokens), max(num_top)), tokens, num_top)
    assert_same(got, [plain(logits[i], tokens[i], num_top[i]) for i in range(6)])
    assert got[0].rank == 1 and got[5].rank == 300 and got[0].top == []


def test_no_alternatives_asked_by_any_row():
    logits = torch.randn(2, 50)
    got = logprobs.token_logprobs(logprobs.compute(logits, torch.tensor([3, 4]), 0), [3, 4], [0, 0])
    assert [g.top for g in got] == [[], []]
    assert_same(got, [plain(logits[0], 3, 0), plain(logits[1], 4, 0)])


def test_half_precision_logits_are_computed_in_float32():
    logits = (torch.randn(3, 64) * 5).to(torch.bfloat16)
    got = logprobs.token_logprobs(logprobs.compute(logits, torch.tensor([1, 2, 3]), 4), [1, 2, 3], [4, 4, 4])
    assert_same(got, [plain(logits[i].float(), i + 1, 4) for i in range(3)])


def test_parts_concatenate_in_order_and_survive_packing():
    logits = torch.randn(5, 30)
    tokens = torch.tensor([1, 2, 3, 4, 5])
    whole = logprobs.compute(logits, tokens, 3)
    parts = LogprobsTensors.cat([logprobs.compute(logits[:2], tokens[:2], 3), logprobs.compute(logits[2:], tokens[2:], 3)])
    unpacked = LogprobsTensors.unpack(parts.pack(), 5, 3)  # as the runner copies them to the host
    assert_same(logprobs.token_logprobs(unpacked, tokens.tolist(), [3] * 5),
                logprobs.token_logprobs(whole, tokens.tolist(), [3] * 5), atol=1e-7)


@torch.no_grad()
def test_equal_transformers_transition_scores_on_its_own_model():
    """transformers' logprobs of the tokens its greedy generate picked (normalised raw logits) are ours."""
    model = hf_model()
    ids = prompt_ids()[0]
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    want = model.compute_transition_scores(out.sequences, out.logits, normalize_logits=True)[0]
    logits = torch.cat(out.logits)  # [6, vocab], raw
    new = out.sequences[0, len(ids):]
    got = logprobs.token_logprobs(logprobs.compute(logits, new, 5), new.tolist(), [5] * 6)
    torch.testing.assert_close(torch.tensor([g.logprob for g in got]), want.float(), rtol=0, atol=1e-5)
    assert all(g.rank == 1 and g.top[0][0] == g.token_id for g in got)  # greedy: the top token each time


def test_the_sampler_reads_logprobs_from_the_raw_logits():
    """Temperature, a bias that forces another token, and a repetition penalty change the draw, not the logprobs."""
    torch.manual_seed(1)
    logits = torch.randn(3, 80)
    forced = int(logits[1].argmin())
    processing = LogitsProcessingBatch(inits=[SlotInit(0, [int(logits[2].argmax())], [])])
    add_sample_row(processing, 1, SamplingParams(logit_bias={forced: 100.0}), None)
    add_sample_row(processing, 2, SamplingParams(repetition_penalty=3.0), 0)
    batch = SamplingBatch([0.0, 0.0, 1.7], [0] * 3, [1.0] * 3, [0.0] * 3, [None, None, 9], [4, 4, 4],
                          processing=processing, logprob_rows=[1, 2], num_top_logprobs=[2, 0])
    sampler = Sampler(CPU)
    tokens = sampler(logits, batch)
    assert tokens[1] == forced
    got = logprobs.token_logprobs(sampler.logprobs(logits, tokens, batch), tokens[[1, 2]].tolist(),
                                  batch.num_top_logprobs)
    assert_same(got, [plain(logits[1], forced, 2), plain(logits[2], int(tokens[2]), 0)])
    assert got[0].rank == 80  # the least likely token, as the model sees it
