"""What a caller may pass as prompts and sampling params, made plain or refused with a message
that says what was wrong and what to pass instead; and one request checked against the engine it
goes to (`RequestMaker`: its vocabulary, max_model_len, tokenizer and per-request adapters).

Token ids are Python ints, or numpy/torch integers (a numpy array of ints is one prompt); a float, a
bool or a string among them is refused rather than rounded. SamplingParams may be given as a dict of
its fields, validated the same way. A prompt string must be valid Unicode: a lone surrogate (what
`bytes.decode(errors="surrogateescape")` leaves for bytes that are not UTF-8) has no token.
"""
from __future__ import annotations

import itertools
import numbers
import operator
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from nanoplug.config import SamplingParams
from nanoplug.engine.penalties import check_token_ids
from nanoplug.errors import RequestError

PROMPT_FORMS = "a string, a list of token ids (ints), or a list of those"


def a_type(value: Any) -> str:
    """'a float', 'an int', 'None': what a caller passed, for messages."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _is_array(value: Any) -> bool:
    """A numpy array or torch tensor (anything with ndim and tolist)."""
    return hasattr(value, "ndim") and hasattr(value, "tolist") and not isinstance(value, (str, bytes))


def _is_token(value: Any) -> bool:
    """Looks like one token id (right or wrong): a number (a 0-d array too), not text or a row of ids."""
    if _is_array(value):
        return value.ndim == 0
    return isinstance(value, numbers.Number) or (hasattr(value, "__index__") and not isinstance(value, (str, bytes)))


def prompt_list(prompts: Any) -> list[Any]:
    """The prompts as a list: one string or one token-id list (or 1-d array) becomes a list of one."""
    if prompts is None:
        raise RequestError(f"prompts is None; give {PROMPT_FORMS}")
    if isinstance(prompts, str):
        return [prompts]
    if _is_array(prompts):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise RequestError(f"prompts is a {prompts.ndim}-d array; give a 1-d array of token ids (one prompt) "
                           "or a 2-d one (a prompt per row)")
    if isinstance(prompts, (list, tuple)):
        return [prompts] if prompts and _is_token(prompts[0]) else list(prompts)
    raise RequestError(f"prompts is {a_type(prompts)}; give {PROMPT_FORMS}")


def lone_surrogate(text: str) -> str | None:
    """A description of the first lone surrogate in `text`, or None when it is valid Unicode."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        byte = f" (the byte 0x{ord(char) - 0xDC00:02x} left undecoded)" if 0xDC80 <= ord(char) <= 0xDCFF else ""
        return f"a lone surrogate {char!r} at character {exc.start}{byte}"


def check_text(what: str, text: str) -> None:
    """Refuse text that is not valid Unicode, naming where and the fix."""
    bad = lone_surrogate(text)
    if bad:
        raise RequestError(f"{what} has {bad}, which is not valid Unicode text and has no token; decode the bytes "
                           "as UTF-8 (bytes.decode('utf-8', errors='replace') keeps the rest), or pass token ids")


def token_ids(index: int, prompt: Any) -> list[int] | None:
    """A token-id prompt as a list of ints; None for a text prompt (checked to be valid Unicode)."""
    if isinstance(prompt, str):
        check_text(f"prompt {index}", prompt)
        return None
    if isinstance(prompt, bytes):
        raise RequestError(f"prompt {index} is bytes; decode it to a string first: data.decode('utf-8')")
    if _is_array(prompt):
        if prompt.ndim != 1:
            raise RequestError(f"prompt {index} is a {prompt.ndim}-d array; give a 1-d array of token ids")
        prompt = prompt.tolist()
    elif not isinstance(prompt, (list, tuple)):
        raise RequestError(f"prompt {index} is {a_type(prompt)}; give a string or a list of token ids (ints)")
    ids = []
    for pos, token in enumerate(prompt):
        if isinstance(token, int) and not isinstance(token, bool):
            ids.append(token)
            continue
        try:
            if isinstance(token, bool) or not hasattr(token, "__index__"):
                raise TypeError
            ids.append(operator.index(token))  # numpy.int64, a 0-d integer tensor
        except TypeError:
            raise RequestError(
                f"prompt {index} has {token!r} ({a_type(token)}) at position {pos}; token ids are "
                "integers: give ints (or a numpy array of an integer dtype), e.g. ids.astype('int64')"
            ) from None
    return ids


def _validated(where: str, value: Mapping) -> SamplingParams:
    try:
        return SamplingParams(**value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']} (got {e.get('input')!r})"
                             for e in exc.errors())
        raise RequestError(f"{where} is not a valid SamplingParams: {problems}") from exc
    except TypeError as exc:  # keys that are not strings
        raise RequestError(f"{where} is not a valid SamplingParams: {exc}") from exc


def params_list(params: Any, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from None (the defaults), one for all, a dict, or a list of those."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, Mapping):
        return [_validated("sampling_params", params)] * count
    if not isinstance(params, (list, tuple)):
        raise RequestError(f"sampling_params is {a_type(params)}; give SamplingParams(...), a dict of its "
                           "fields, or a list of those with one per prompt")
    if len(params) != count:
        raise RequestError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
    out = []
    for i, p in enumerate(params):
        if isinstance(p, SamplingParams):
            out.append(p)
        elif isinstance(p, Mapping):
            out.append(_validated(f"sampling_params[{i}]", p))
        else:
            raise RequestError(f"sampling_params[{i}] is {a_type(p)}; give a SamplingParams (or a dict of its fields) for "
                               "each prompt, or sampling_params=None for the defaults")
    return out


@dataclass
class EngineRequest:
    """One request, validated and tokenized by `RequestMaker.make` (`EngineCore.make_request`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the caller gave text
    # True: an update every step that adds tokens (streams); False: one update when it finishes, with all
    # of its tokens and text (vLLM's FINAL_ONLY: generate() needs no per-token traffic)
    incremental_text: bool = True
    arrived_at: float = 0.0  # set by EngineCore.add_request: the start of its queue time


class RequestMaker:
    """Tokenizes and checks prompts and their SamplingParams against one engine (any thread)."""

    def __init__(self, tokenizer: Any, tokenizer_lock: threading.Lock, max_model_len: int, vocab_size: int,
                 adapter_ids: dict[str, int]):
        self.tokenizer, self.tokenizer_lock = tokenizer, tokenizer_lock
        self.max_model_len, self.vocab_size, self.adapter_ids = max_model_len, vocab_size, adapter_ids
        self._next_id = itertools.count()

    def make(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
             *, index: int = 0, incremental_text: bool = True) -> EngineRequest:
        """One prompt and its SamplingParams as a request; raises RequestError saying what is wrong.

        `index`: the prompt's place in the caller's list, for messages."""
        params = params if params is not None else SamplingParams()
        ids = token_ids(index, prompt)
        if ids is None:
            if self.tokenizer is None:
                raise RequestError(f"prompt {index} is text, but this LLM has no tokenizer (skip_tokenizer_init=True); "
                                   "give token ids, or create the LLM without skip_tokenizer_init")
            with self.tokenizer_lock:
                ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        if not ids:
            raise RequestError(f"prompt {index} is empty; give it at least one token")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise RequestError(
                f"prompt {index} has {len(ids)} tokens, but max_model_len is {limit} (room for the prompt and "
                f"at least one new token); shorten the prompt or raise max_model_len"
            )
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt {index} has token id {bad[0]} outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"prompt {index} has stop strings, but this LLM has no tokenizer "
                               "(skip_tokenizer_init=True) to read text; use stop_token_ids")
        check_token_ids(params, vocab, f"prompt {index}")
        if params.adapter is not None and params.adapter not in self.adapter_ids:
            loaded = ", ".join(map(repr, self.adapter_ids)) or "none"
            raise RequestError(
                f"prompt {index} asks for adapter {params.adapter!r}, but this engine serves per request: {loaded}; "
                "pick one of those, or load it with LLM(..., adapters=[{'path': DIR, 'name': NAME, 'merge': False}])"
            )
        if request_id is None:
            request_id = f"req-{next(self._next_id)}"
        return EngineRequest(request_id, ids, params, prompt if isinstance(prompt, str) else None, incremental_text)
