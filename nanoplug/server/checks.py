"""The front end's checks of a parsed request, the same in both layouts and before any per-choice work:
anything the engine (or the wire to its process) could not take is a 400 naming the field, and a
request whose choices could never fit the server is a 400, not a 503 a client would retry forever.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from nanoplug.engine.requests import lone_surrogate
from nanoplug.server.errors import bad_request

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _strings(value: Any, path: str):
    """Every string in a parsed body with its path; a list of ints (token ids, possibly a million of
    them) is passed over at once: the body's types make such a list all ints."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        for key in value.model_fields_set:  # what the client sent (extra fields included)
            yield from _strings(getattr(value, key), f"{path}.{key}" if path else key)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, path)
            yield from _strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        if value and type(value[0]) is int:
            return
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}.{i}" if path else str(i))


def check_text(body: Any) -> None:
    """Every string is valid Unicode: JSON may carry a lone surrogate ("\\ud800") no tokenizer or UTF-8 takes."""
    for path, text in _strings(body, ""):
        problem = lone_surrogate(text)
        if problem is not None:
            raise bad_request(f"{path} has {problem}; send valid Unicode text", param=path, code="invalid_value")


def check_request(body: Any, engine: Any, capacity: int, num_prompts: int, max_prompts: int,
                  max_tokens: int | None) -> None:
    check_text(body)
    n = body.n or 1
    if num_prompts > max_prompts:
        raise bad_request(f"the request has {num_prompts} prompts; this server takes at most {max_prompts} in one "
                          "request (--max-prompts); split it", param="prompt", code="too_many_prompts")
    if num_prompts * n > capacity:
        raise bad_request(f"the request asks for {num_prompts * n} choices ({num_prompts} prompt(s) x n={n}), more "
                          f"than this server ever holds at once ({capacity}); send fewer prompts or a smaller n",
                          param="n", code="too_many_choices")
    if body.seed is not None and not INT64_MIN <= body.seed <= INT64_MAX - (n - 1):
        raise bad_request(f"seed: {body.seed} is outside the 64-bit range a seed takes ([-2^63, 2^63 - 1], less "
                          "n - 1 for the choices' seeds)", param="seed", code="invalid_value")
    if max_tokens is not None and max_tokens > engine.max_model_len:
        raise bad_request(f"max_tokens: {max_tokens} is more than the model's context ({engine.max_model_len} tokens "
                          "with the prompt); ask for fewer", param="max_tokens", code="invalid_value")
    vocab = engine.vocab_size
    if body.top_k is not None and body.top_k > vocab:
        raise bad_request(f"top_k: {body.top_k} is more than the vocabulary ({vocab} tokens); use at most {vocab}, "
                          "or -1 for all", param="top_k", code="invalid_value")
    for param, ids in (("stop_token_ids", body.stop_token_ids or []),
                       ("logit_bias", [int(k) for k in body.logit_bias or {}])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param,
                              code="invalid_value")


def check_token_prompts(prompts: list[Any], vocab: int) -> None:
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
                raise bad_request(f"{where} has token id {bad[0]} outside the vocabulary [0, {vocab})",
                                  param="prompt", code="invalid_value")
