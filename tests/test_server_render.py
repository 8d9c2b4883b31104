"""The response shapes the server writes, read back by the official client's own models (no server).

Logprobs are written from `TokenLogprobs`-shaped entries (issue 14 item 2's type: token_id, logprob,
rank, top); the end-to-end comparison with the engine's values is in test_server.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import CompletionChoice

from nanoplug.server.render import Responder, encode
from nanoplug.server.streams import Delta

TEXT = {1: "Hello", 2: ",", 3: " world", 4: "!"}


@dataclass
class Entry:
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


ENTRIES = [Entry(1, -0.1, 1, [(1, -0.1), (3, -2.5)]), Entry(2, -1.5, 2, [(4, -0.5), (2, -1.5)]),
           Entry(3, -0.2, 1, [(3, -0.2), (1, -3.0)])]
USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_logprobs_shape_and_offsets():
    r = Responder(chat=False, model="m", token_text=TEXT.__getitem__)
    body = Completion.model_validate(r.body(["Hello, world"], ["length"], [ENTRIES], USAGE, echoed=None))
    lp = body.choices[0].logprobs
    assert lp.tokens == ["Hello", ",", " world"]
    assert lp.token_logprobs == [-0.1, -1.5, -0.2]
    assert lp.text_offset == [0, 5, 6]
    assert lp.top_logprobs[1] == {"!": -0.5, ",": -1.5}  # the chosen token is in its top dict (k + 1 at most)
    echoed = Completion.model_validate(r.body(["Say: Hello, world"], ["length"], [ENTRIES], USAGE, echoed=["Say: "]))
    assert echoed.choices[0].logprobs.text_offset == [5, 10, 11]
    assert Completion.model_validate(r.body(["x"], ["stop"], [None], USAGE)).choices[0].logprobs is None


def test_streamed_completion_logprobs_continue_the_offsets():
    r = Responder(chat=False, model="m", token_text=TEXT.__getitem__)
    # (the client reads stream chunks without validation: its Completion model insists on a finish_reason)
    first = json.loads(r.chunk(0, Delta(token_ids=[1, 2], text="Hello,", logprobs=ENTRIES[:2])))
    last = Completion.model_validate_json(r.chunk(0, Delta(token_ids=[3], text=" world", logprobs=ENTRIES[2:],
                                                           finished=True, finish_reason="length")))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 5] and first["choices"][0]["finish_reason"] is None
    assert last.choices[0].logprobs.text_offset == [6] and last.choices[0].finish_reason == "length"


def test_chat_logprobs_shape():
    r = Responder(chat=True, model="m", token_text=TEXT.__getitem__)
    body = ChatCompletion.model_validate(r.body(["Hello, world"], ["stop"], [ENTRIES], USAGE))
    content = body.choices[0].logprobs.content
    assert [c.token for c in content] == ["Hello", ",", " world"]
    assert [c.logprob for c in content] == [-0.1, -1.5, -0.2]
    assert content[2].bytes == list(b" world")
    assert [t.token for t in content[1].top_logprobs] == ["!", ","]
    chunk = ChatCompletionChunk.model_validate_json(r.chunk(0, Delta(token_ids=[1], text="Hello", logprobs=ENTRIES[:1])))
    assert chunk.choices[0].delta.content == "Hello" and chunk.choices[0].logprobs.content[0].token == "Hello"
    role = ChatCompletionChunk.model_validate_json(r.first_chunk(0))
    assert role.choices[0].delta.role == "assistant"


def test_usage_chunk_and_errors_encode():
    r = Responder(chat=False, model="m")
    chunk = Completion.model_validate_json(r.usage_chunk(USAGE))
    assert chunk.choices == [] and chunk.usage.total_tokens == 6
    assert CompletionChoice.model_validate({"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"})
    assert encode({"a": "é"}) == '{"a":"é"}'
