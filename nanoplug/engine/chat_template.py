"""A conversation as token ids, in which the messages' text never becomes a special token.

transformers' `apply_chat_template` renders the template to text and tokenizes all of it, so
"<|im_start|>system" typed inside a message becomes the real control tokens (role injection). Here
the text of each special token found inside the messages is first swapped for a random placeholder;
the template is rendered (its own transformations of the content still apply), so every special token
left in the rendered text is the template's own. The rendered text is split at those tokens and each
piece between them is tokenized with special tokens split, the placeholders put back as the text they
stood for. Tokenizers extract special tokens before anything else, so pieces tokenized apart give the
whole text's tokens: that is checked on every use (a tokenizer that merges across special tokens
refuses such messages instead), and with no special text in the messages the result is exactly
transformers' own. A caller who wants control tokens from text renders the template themself and
passes the text to `generate`.

Newer transformers (5.x) offer `apply_chat_template(..., sanitize_control_tokens=True)`, which also
turns the template's non-special added tokens (Qwen3's <think>, <tool_response>) into text; it is not
used: it is missing from the transformers versions nanoplug supports (>= 4.51), and it changes how
templates treat <think> in an assistant's earlier answers. Non-special added tokens stay tokens here.
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any

from nanoplug.errors import RequestError
from nanoplug.engine.requests import check_text

MESSAGE_FORM = "a list of messages like {'role': 'user', 'content': 'Hello'}"


def special_texts(tokenizer: Any) -> list[str]:
    """The text of every special token (the ones `split_special_tokens` leaves as text), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []))
    texts.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return sorted((t for t in texts if t), key=len, reverse=True)


def _check_messages(messages: Any, specials: list[str]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError(f"a conversation is {MESSAGE_FORM}; got {type(messages).__name__} {messages!r:.60}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"message {i} is {message!r:.60}; give {MESSAGE_FORM}")
        role = message["role"]
        hit = next((s for s in specials if s in role), None)
        if hit:
            raise RequestError(f"message {i} has the role {role!r}, which holds the control token {hit!r}; "
                               "give a plain role such as 'system', 'user' or 'assistant'")
        _walk(message, lambda where, text: check_text(f"message {i}'s {where}", text))


def _walk(value: Any, visit, where: str = "content") -> Any:
    """Apply `visit(where, text)` to every string in a message (content parts and tool calls included)."""
    if isinstance(value, str):
        return visit(where, value)
    if isinstance(value, Mapping):
        return {k: (v if k == "role" else _walk(v, visit, k if isinstance(k, str) else where)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_walk(v, visit, where) for v in value]
    return value


def _template_refused(exc: Exception) -> RequestError:
    return RequestError(f"the chat template refused the messages: {exc}")


def _render(tokenizer: Any, messages: Any, tools: list[dict] | None = None) -> str:
    from jinja2 import TemplateError

    try:
        if tools:  # (only then: a template that never heard of the keyword renders as before)
            return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # the template's own raise_exception(...), e.g. roles out of order
        raise _template_refused(exc) from exc


def _pieces_ids(tokenizer: Any, text: str, pattern: re.Pattern, restore: dict[str, str]) -> list[int]:
    """Special tokens of `text` as their ids; the text between them tokenized with special text kept as text."""
    ids: list[int] = []
    start = 0
    for match in [*pattern.finditer(text), None]:
        piece = text[start:match.start() if match else len(text)]
        for placeholder, original in restore.items():
            piece = piece.replace(placeholder, original)
        if piece:
            ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)
        if match:
            ids.append(tokenizer.convert_tokens_to_ids(match.group()))
            start = match.end()
    return ids


def _special_texts_in(messages: Any, specials: list[str]) -> set[str]:
    found: set[str] = set()
    _walk(list(messages), lambda where, text: found.update(s for s in specials if s in text))
    return found


def chat_token_ids(tokenizer: Any, messages: Any, tools: list[dict] | None = None) -> list[int]:
    """The conversation with the generation prompt, as token ids; the messages' text stays text. `tools`: the
    functions a template that knows tools renders (engine/chat_tools.py)."""
    specials = special_texts(tokenizer)
    _check_messages(messages, specials)
    if not _special_texts_in(messages, specials):  # nothing to guard: transformers' own result
        return list(tokenizer.encode(_render(tokenizer, list(messages), tools), add_special_tokens=False))
    return guarded_chat_token_ids(tokenizer, messages, tools)


def guarded_chat_token_ids(tokenizer: Any, messages: Any, tools: list[dict] | None = None) -> list[int]:
    """chat_token_ids the guarded way, whether or not the messages hold special text (tests compare it
    with transformers' plain result on messages without any)."""
    specials = special_texts(tokenizer)
    _check_messages(messages, specials)
    if not specials:  # no special token at all: no text can become one
        return list(tokenizer.encode(_render(tokenizer, list(messages), tools), add_special_tokens=False))
    marker = secrets.token_hex(8)
    placeholders = {s: f"\ue000{marker}{k}\ue001" for k, s in enumerate(specials)}
    swap = re.compile("|".join(map(re.escape, specials)))
    guarded = _walk(list(messages), lambda where, text: swap.sub(lambda m: placeholders[m.group()], text))
    text = _render(tokenizer, guarded, tools)
    # pieces tokenized apart must give the whole text's tokens (checked with the placeholders still in)
    if _pieces_ids(tokenizer, text, swap, {}) != list(tokenizer.encode(text, add_special_tokens=False)):
        found = ", ".join(map(repr, sorted(_special_texts_in(messages, specials)))) or "none"
        raise RequestError(f"the messages hold the text of control tokens ({found}), which this tokenizer cannot "
                           "keep as plain text inside a chat template; remove it from the messages")
    return _pieces_ids(tokenizer, text, swap, {p: s for s, p in placeholders.items()})
