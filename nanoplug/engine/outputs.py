"""What a request's tokens mean to its caller: when it ends (EOS, a stop token, a stop string, its
length) and what text each step added, detokenized incrementally where the caller reads text as it
comes (streams) or a stop string must be found, and decoded once at the end otherwise.

`OutputProcessor` keeps no engine state: the engine core hands it each request's `RequestState` and
each new token, and turns the answers into `RequestUpdate`s; `LLM` assembles those into
`RequestOutput`s and `StreamDelta`s.

A request with n > 1 has one `RequestState` per sample (`samples`, on the first sample's state), and
its updates say which sample they extend (`index`); as in vLLM, `finished` says the whole request has
ended, and a sample's own end shows as its `finish_reason`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nanoplug.engine.detokenizer import IncrementalDetokenizer
from nanoplug.worker.logprobs import TokenLogprobs
from nanoplug.engine.sequence import Sequence


@dataclass
class RequestUpdate:
    """What one step added to one request (to one of its samples, when it has several)."""

    request_id: str
    token_ids: list[int]  # tokens this step added (may be empty when only finishing)
    text: str  # text this step added (stop strings already cut; EOS left out)
    finished: bool  # the request has ended: every one of its samples
    finish_reason: str | None  # this sample's: "stop" | "length" | "abort", or None while it runs
    num_prompt_tokens: int
    num_cached_tokens: int
    # added by the sampling work (issue 14 item 2): logprobs of each token in token_ids, when asked
    logprobs: list[TokenLogprobs] | None = None
    logits: list[torch.Tensor] | None = None  # the raw logits row of each token in token_ids (output_logits=True)
    index: int = 0  # which sample (0..n-1) token_ids, text, finish_reason and logprobs belong to
    # the prompt's logprobs (None first: the first token has none), once, in the first update with tokens
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    queue_time: float | None = None  # seconds from add_request to first scheduled, once, in the first update


@dataclass
class CompletionOutput:
    """One sample of a prompt (a request with n > 1 has n of them)."""

    index: int  # which sample, 0..n-1
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RequestOutput:
    """The finished result of one prompt: its samples in `outputs` (vLLM's shape); `text`, `token_ids`,
    `finish_reason`, `logprobs` and `logits` read the first, as they did before there could be several."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # None first (the first token has none), when asked

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def logits(self) -> list[torch.Tensor]:
        return self.outputs[0].logits


@dataclass
class StreamDelta:
    """What one step added to one sample of a streamed request; each sample's last delta is marked finished."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    index: int = 0  # which sample (n > 1)
    logprobs: list[TokenLogprobs] | None = None  # of token_ids, when asked


@dataclass(eq=False)
class RequestState:
    """One request (or one sample of it) as its outputs see it: the sequence the scheduler runs, and what
    was reported so far."""

    request_id: str
    seq: Sequence
    incremental: bool  # the caller reads text step by step
    detok: IncrementalDetokenizer | None = None
    reported: int = 0  # completion tokens handed out in updates
    logits: list[torch.Tensor] = field(default_factory=list)  # rows not yet handed out
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # not yet handed out
    samples: list["RequestState"] = field(default_factory=list)  # the first sample's: every sample's state, in order
    final_sent: bool = False  # the update that ends this sample went out
    prompt_logprobs_sent: bool = False
    queue_time_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len

    def start(self, request_id: str, seq: Sequence, incremental: bool) -> RequestState:
        """A request's state: with a detokenizer where text is read as it comes or stop strings are searched."""
        detok = None
        if self.tokenizer is not None and (seq.params.stop or incremental):
            detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, seq.params.stop)
        state = RequestState(request_id, seq, incremental, detok)
        if seq.root is None:
            state.samples.append(state)
        return state

    def finish_reason(self, state: RequestState, token: int) -> str | None:
        """Why `token` (just appended) ends the request, if it does: EOS or a stop token (left out of the
        text), a stop string (the text cut before it), or its length."""
        seq, detok = state.seq, state.detok
        p = seq.params
        reason, cut = None, None
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif detok is not None:
            detok.add(token)
            cut = detok.find_stop() if p.stop else None
            if cut is not None:
                detok.text, reason = detok.text[:cut], "stop"
        known = len(seq.token_ids) - seq.num_pending
        if reason is None and (known - seq.num_prompt_tokens >= p.max_tokens or known >= self.max_model_len):
            reason = "length"
        if reason is not None and detok is not None and cut is None:
            detok.flush()  # the text ends here: keep even a partial character, as decode() of the ids does
        return reason

    def update(self, state: RequestState) -> RequestUpdate:
        """The tokens and text added since the last update (all of the text at the end, unless incremental)."""
        seq = state.seq
        start, end = seq.num_prompt_tokens + state.reported, seq.num_known_tokens
        new = seq.token_ids[start:end]  # only the new tokens: a step's cost stays flat as outputs grow
        state.reported = end - seq.num_prompt_tokens
        done = state.final_sent = seq.finish_reason is not None  # this sample has ended
        if state.incremental:
            text = state.detok.take(final=done) if state.detok is not None else ""
        else:
            text = self.final_text(state) if done else ""
        logits, state.logits = (state.logits, []) if state.logits else (None, state.logits)
        update = RequestUpdate(state.request_id, new, text, (seq.root or seq).request_finished, seq.finish_reason,
                               seq.num_prompt_tokens, seq.num_cached_tokens, logits=logits, index=seq.sample_index)
        if not state.queue_time_sent and seq.scheduled_at is not None:
            update.queue_time, state.queue_time_sent = seq.scheduled_at - seq.arrived_at, True
        if seq.params.logprobs is not None:
            update.logprobs, state.logprobs = state.logprobs, []
        if seq.prompt_logprobs is not None and not state.prompt_logprobs_sent and (new or done):
            update.prompt_logprobs, state.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        return update

    def final_text(self, state: RequestState) -> str:
        """The whole completion's text: stop strings cut, a final EOS or stop token left out."""
        if self.tokenizer is None:
            return ""
        seq = state.seq
        if state.detok is not None and seq.params.stop:
            return state.detok.text
        ids = seq.completion_token_ids
        if seq.finish_reason == "stop" and ids and (ids[-1] in self.eos_token_ids or ids[-1] in seq.params.stop_token_ids):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
