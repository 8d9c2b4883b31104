"""The response bodies and stream chunks of the OpenAI API, as plain dicts encoded once by msgspec.

`LOGPROBS_RENDERABLE` says whether the server can write the engine's per-token logprobs (issue 14 item
2 adds `RequestUpdate.logprobs`); until that lands the server refuses `logprobs` with a 400 (see
sampling.py), so no response ever carries a made-up value.
"""
from __future__ import annotations

import time
import uuid

import msgspec

from nanoplug.server.streams import Delta

LOGPROBS_RENDERABLE = False
_encode = msgspec.json.Encoder().encode


def encode(obj: dict) -> str:
    return _encode(obj).decode()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Responder:
    """Builds one response's chunks and final body: completion (`text_completion`) or chat."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # ------------------------------------------------------------------------------- streaming
    def first_chunk(self, index: int, text: str = "", with_usage: bool = False) -> str:
        """Chat: the assistant role; completions with echo: the prompt."""
        delta = {"role": "assistant", "content": ""} if self.chat else None
        choice = ({"index": index, "delta": delta, "logprobs": None, "finish_reason": None} if self.chat
                  else {"index": index, "text": text, "logprobs": None, "finish_reason": None})
        return self._chunk(choice, with_usage)

    def chunk(self, index: int, delta: Delta, with_usage: bool = False) -> str:
        reason = delta.finish_reason if delta.finished else None
        if self.chat:
            content = {"content": delta.text} if delta.text or not delta.finished else {}
            choice = {"index": index, "delta": content, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta.text, "logprobs": None, "finish_reason": reason}
        return self._chunk(choice, with_usage)

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
    def body(self, texts: list[str], reasons: list[str | None], usage_body: dict) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": reason} for i, (text, reason) in enumerate(zip(texts, reasons))]
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                       for i, (text, reason) in enumerate(zip(texts, reasons))]
        body = self._envelope(choices, chunk=False)
        body["usage"] = usage_body
        return body
