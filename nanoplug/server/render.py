"""The response bodies and stream chunks of the OpenAI API, as plain dicts encoded once by msgspec.

Logprobs arrive from the engine as `TokenLogprobs`-shaped entries (token_id, logprob, rank, top: the
(token id, logprob) pairs of the most likely tokens, issue 14 item 2) and are written in the two
shapes OpenAI uses: completions' parallel lists and chat's `content` list. Token strings are each
token decoded alone, as vLLM writes them.
"""
from __future__ import annotations

import time
import uuid
from functools import lru_cache
from typing import Any, Callable

import msgspec

from nanoplug.server.streams import Delta

_encode = msgspec.json.Encoder().encode


def encode(obj: dict) -> str:
    return _encode(obj).decode()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_texts(tokenizer: Any) -> Callable[[int], str]:
    """Token id -> its text decoded alone (cached: the same ids come back in every top list)."""
    return lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))


def completion_logprobs(entries: list[Any], text: Callable[[int], str], offset: int) -> dict:
    """Completions' shape; each top dict holds the chosen token too, as OpenAI's does (up to k + 1)."""
    tokens = [text(e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for e, t in zip(entries, tokens):
        if e.logprob is None:  # a prompt's first token: nothing before it to score it
            tops.append(None)
            continue
        top = {text(i): lp for i, lp in e.top}
        top.setdefault(t, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


class _Unscored:
    """The first prompt token's entry: nothing before it scores it."""

    __slots__ = ("token_id",)
    logprob = rank = None
    top = ()

    def __init__(self, token_id: int):
        self.token_id = token_id


def prompt_entries(prompt_token_ids: list[int] | None, entries: list[Any] | None) -> list[Any]:
    """The engine's prompt logprobs (None first) as one entry per prompt token, the first unscored."""
    if not entries or not prompt_token_ids:
        return []
    return [_Unscored(prompt_token_ids[0]), *entries[1:]]


def vllm_prompt_logprobs(entries: list[Any] | None, text: Callable[[int], str]) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None first, then {token id: {logprob, rank, decoded_token}}
    for the token itself and the most likely ones."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        top = {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": text(i)} for r, (i, lp) in enumerate(e.top)}
        top[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": text(e.token_id)}
        out.append(top)
    return out


def chat_logprobs(entries: list[Any], text: Callable[[int], str]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        t = text(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}


class Responder:
    """Builds one response's chunks and final body: completion (`text_completion`) or chat."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] | None = None):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.token_text = token_text
        self.offsets: dict[int, int] = {}  # completions: characters written so far per choice (text_offset)

    def logprobs(self, index: int, entries: list[Any] | None, text: str = "") -> dict | None:
        """This choice's logprobs of `entries` (None when not asked), advancing its text offset by `text`."""
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        if entries is None:
            return None
        return chat_logprobs(entries, self.token_text) if self.chat else completion_logprobs(entries, self.token_text, offset)

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # ------------------------------------------------------------------------------- streaming
    def first_chunk(self, index: int, text: str = "", with_usage: bool = False) -> str:
        """Chat: the assistant role; completions with echo: the prompt."""
        self.offsets[index] = len(text)
        delta = {"role": "assistant", "content": ""} if self.chat else None
        choice = ({"index": index, "delta": delta, "logprobs": None, "finish_reason": None} if self.chat
                  else {"index": index, "text": text, "logprobs": None, "finish_reason": None})
        return self._chunk(choice, with_usage)

    def chunk(self, index: int, delta: Delta, with_usage: bool = False) -> str:
        reason = delta.finish_reason if delta.finished else None
        logprobs = self.logprobs(index, delta.logprobs, delta.text)
        if self.chat:
            content = {"content": delta.text} if delta.text or not delta.finished else {}
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": reason}
        return self._chunk(choice, with_usage)

    def tool_chunks(self, index: int, deltas: list[dict], reason: str | None, finished: bool,
                    with_usage: bool = False) -> list[str]:
        """Chat chunks of `deltas` (content or tool-call deltas, server/tools.py), the last one carrying the
        finish reason when the choice has finished."""
        if finished and not deltas:
            deltas = [{}]
        return [self._chunk({"index": index, "delta": d, "logprobs": None,
                             "finish_reason": reason if finished and k == len(deltas) - 1 else None}, with_usage)
                for k, d in enumerate(deltas)]

    def _chunk(self, choice: dict, with_usage: bool) -> str:
        body = self._envelope([choice], chunk=True)
        if with_usage:
            body["usage"] = None
        return encode(body)

    def usage_chunk(self, usage_body: dict) -> str:
        body = self._envelope([], chunk=True)
        body["usage"] = usage_body
        return encode(body)

    # --------------------------------------------------------------------------- whole response
    def body(self, texts: list[str], reasons: list[str | None], logprobs: list[list[Any] | None], usage_body: dict,
             echoed: list[str] | None = None) -> dict:
        """The whole response; `echoed`: the prompt text each completion text starts with (echo)."""
        lps = [None if entries is None else chat_logprobs(entries, self.token_text) if self.chat
               else completion_logprobs(entries, self.token_text, len(echoed[i]) if echoed else 0)
               for i, entries in enumerate(logprobs)]
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                        "finish_reason": reason} for i, (text, reason, lp) in enumerate(zip(texts, reasons, lps))]
        else:
            choices = [{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
                       for i, (text, reason, lp) in enumerate(zip(texts, reasons, lps))]
        body = self._envelope(choices, chunk=False)
        body["usage"] = usage_body
        return body
