"""Sampling at a temperature alone on the CPU, by the inverse of each row's cumulative distribution: one
uniform number a row, where the plain sampler draws an exponential number for every logit (the CPU's
generator takes most of a step's sampling time at a large vocabulary).

Token i is drawn when u falls in its share of the row's cumulative sum of exp((logit - max) / T), which is
exactly softmax(logits / T)_i; u lies in (0, total], so a token of probability 0 (a -inf logit) is never drawn.
"""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab], from softmax(logits / temperatures[:, None]) (temperatures
    float32 > 0), its uniform numbers keyed by `seed`."""
    scaled = logits.float() / temperatures.unsqueeze(1)
    weights = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    cumulative = torch.cumsum(weights, dim=-1)
    u = 1.0 - torch.rand((logits.shape[0], 1), generator=torch.Generator().manual_seed(seed))  # (0, 1]
    tokens = torch.searchsorted(cumulative, u * cumulative[:, -1:])
    return tokens.squeeze(1).clamp_(max=logits.shape[1] - 1)
