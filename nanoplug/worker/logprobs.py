"""Log-probabilities of chosen tokens and their most likely alternatives.

They are vLLM's default "raw" logprobs: log-softmax of the model's own logits, before temperature,
top-k/top-p/min-p, penalties and logit bias. So they describe the model, and greedy and sampled
requests report the same numbers for the same tokens; the sampled token is not always the top one.
The device computes them for the rows that ask (`compute`), and the host turns the copied-back
tensors (`nanoplug.api.LogprobsTensors`) into `TokenLogprobs` (`token_logprobs`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoplug.api import LogprobsTensors

ROWS_PER_PASS = 256  # prompt logprobs: log-softmax at most this many positions at once (a [rows, vocab] float32)


@dataclass
class TokenLogprobs:
    """One token's log-probability, its rank, and the `k` most likely tokens at its position."""

    token_id: int
    logprob: float
    rank: int  # how many tokens are at least as likely as this one (1: none is more likely)
    top: list[tuple[int, float]]  # (token id, logprob) of the k most likely, most likely first


def token_logprobs(tensors: LogprobsTensors, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """One TokenLogprobs per row of host `tensors`: row i's chosen token is token_ids[i] and keeps num_top[i]
    alternatives."""
    ids, lps = tensors.top_ids.tolist(), tensors.top_logprobs.tolist()
    return [TokenLogprobs(t, lp, rank, list(zip(ids[i][:k], lps[i][:k])))
            for i, (t, lp, rank, k) in enumerate(zip(token_ids, tensors.logprobs.tolist(), tensors.ranks.tolist(),
                                                     num_top))]


def compute(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Raw logprobs of `token_ids` [R] under `logits` [R, V] and the `num_top` most likely tokens of each row.

    No host sync: everything stays on the logits' device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long().view(-1, 1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    if num_top:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = torch.empty(logprobs.shape[0], 0, dtype=torch.int64, device=logprobs.device)
    return LogprobsTensors(chosen.squeeze(1), ranks, top_ids, top_logprobs)
