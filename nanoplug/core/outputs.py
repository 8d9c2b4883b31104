"""What a request's tokens mean to its caller: when it ends (EOS, a stop token, a stop string, its
length) and what text each step added, detokenized incrementally where the caller reads text as it
comes (streams) or a stop string must be found, and decoded once at the end otherwise.

`OutputProcessor` keeps no engine state: the engine core hands it each request's `RequestState` and
each new token, and turns the answers into `RequestUpdate`s; `LLM` assembles those into
`RequestOutput`s and `StreamDelta`s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nanoplug.core.detokenizer import IncrementalDetokenizer
from nanoplug.core.sequence import Sequence


@dataclass
class RequestUpdate:
    """What one step added to one request."""

    request_id: str
    token_ids: list[int]  # tokens this step added (may be empty when only finishing)
    text: str  # text this step added (stop strings already cut; EOS left out)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    # added by the sampling work (issue 14 item 2): logprobs of each token in token_ids, when asked
    logprobs: list[Any] | None = None
    logits: list[torch.Tensor] | None = None  # the raw logits row of each token in token_ids (output_logits=True)


@dataclass
class RequestOutput:
    """The finished result of one prompt."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StreamDelta:
    """What one step added to a streamed request."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


@dataclass(eq=False)
class RequestState:
    """One request as its outputs see it: the sequence the scheduler runs, and what was reported so far."""

    request_id: str
    seq: Sequence
    incremental: bool  # the caller reads text step by step
    detok: IncrementalDetokenizer | None = None
    reported: int = 0  # completion tokens handed out in updates
    logits: list[torch.Tensor] = field(default_factory=list)  # rows not yet handed out


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len

    def start(self, request_id: str, seq: Sequence, incremental: bool) -> RequestState:
        """A request's state: with a detokenizer where text is read as it comes or stop strings are searched."""
        detok = None
        if self.tokenizer is not None and (seq.params.stop or incremental):
            detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, seq.params.stop)
        return RequestState(request_id, seq, incremental, detok)

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
        if reason is None and (seq.num_completion_tokens >= p.max_tokens or seq.num_known_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None and detok is not None and cut is None:
            detok.flush()  # the text ends here: keep even a partial character, as decode() of the ids does
        return reason

    def update(self, state: RequestState) -> RequestUpdate:
        """The tokens and text added since the last update (all of the text at the end, unless incremental)."""
        seq = state.seq
        ids = seq.completion_token_ids
        new = ids[state.reported:]
        state.reported = len(ids)
        finished = seq.finish_reason is not None
        if state.incremental:
            text = state.detok.take(final=finished) if state.detok is not None else ""
        else:
            text = self.final_text(state) if finished else ""
        logits, state.logits = (state.logits, []) if state.logits else (None, state.logits)
        return RequestUpdate(state.request_id, new, text, finished, seq.finish_reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, logits=logits)

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
