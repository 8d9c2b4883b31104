"""The rejection sampler of speculative steps (vLLM v1's `RejectionSampler`, for drafts given as tokens).

A speculative step has, for a sequence with k drafts, k + 1 sample rows: row j holds the target's distribution
p_j for the position draft j + 1 would take (rows come from the logits of the last token and of each draft).
Each draft is accepted with probability p_j(draft), the target's own probability of it (the draft
distribution is one-hot: n-gram lookups and argmax proposers); a rejected row instead draws from p_j with the
draft's mass removed and renormalised. So each emitted token has, given the ones before it, exactly the target's
distribution: P(x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x). Rows past the last draft
(the bonus row) draw from p as any row. At temperature 0 the draft is accepted when it is the argmax, and the
argmax is emitted otherwise: greedy output is the non-speculative output, token for token.

Each row is decided independently here; the engine keeps, per sequence, the rows up to its first rejection.
p_j is the same filtered distribution the plain sampler draws from (temperature, top-k, top-p, min-p, after
penalties, bias and grammar masks), and a seeded request draws its acceptance and its noise from
(seed, position), so it is reproducible whatever else is in the batch.
"""
from __future__ import annotations

import torch

from nanoplug.api import DraftBatch, SamplingBatch, to_device
from nanoplug.worker.seeded import seeded_uniform

_SALT = 0x9E3779B97F4A7C15  # keys a seeded row's acceptance draw apart from its token noise


def rejection_sample(sampler, logits: torch.Tensor, batch: SamplingBatch,
                     drafts: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R], accepted [D]): each row's token (its draft where accepted) and whether each draft row
    accepted its draft. `sampler`: the step's Sampler (its greedy kernel, generator and seeded noise);
    `logits`: after penalties, bias and masks."""
    dev = logits.device
    rows = to_device(drafts.rows, torch.int64, dev)
    draft = to_device(drafts.tokens, torch.int64, dev)
    if batch.all_greedy:
        tokens = sampler.greedy(logits)
        return tokens, tokens.index_select(0, rows) == draft
    temps = to_device(batch.temperatures, torch.float32, dev)
    probs = sampler.probabilities(logits, batch, temps)
    uniform = torch.rand(len(drafts.rows), device=dev, generator=sampler.generator)
    for i, row in enumerate(drafts.rows):
        seed = batch.seeds[row]
        if seed is not None:
            uniform[i] = seeded_uniform(seed, batch.positions[row], _SALT)
    accepted = uniform < probs[rows, draft]
    probs[rows, draft] = 0.0  # a rejected row draws from what is left (an accepted one keeps its draft below)
    tokens = sampler.draw(probs, batch)
    tokens[rows] = torch.where(accepted, draft, tokens.index_select(0, rows))
    if any(t == 0.0 for t in batch.temperatures):  # rows at temperature 0 in a mixed batch: argmax, as greedy
        greedy = sampler.greedy(logits)
        cold = temps == 0
        tokens = torch.where(cold, greedy, tokens)
        accepted = torch.where(cold.index_select(0, rows), greedy.index_select(0, rows) == draft, accepted)
    return tokens, accepted
