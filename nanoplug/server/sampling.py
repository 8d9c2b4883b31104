"""From an OpenAI request to the engine's SamplingParams, or a 400 that names the field.

A field nanoplug cannot honour is refused only when its value is not the default (a client sending
`"presence_penalty": 0` must work). Whether the engine honours a sampling feature is read from
`SamplingParams.model_fields` itself, so the penalties, `logit_bias` and `logprobs` switch on here the
moment the engine's SamplingParams gains them (issue 14, item 2), with no change to the server.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from nanoplug.config import SamplingParams
from nanoplug.server.errors import bad_request
from nanoplug.server.protocol import ChatRequest, CompletionRequest, _Sampling

# request field -> (SamplingParams field, the value that asks for nothing)
ENGINE_FEATURES = {
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "logit_bias": ("logit_bias", {}),
}


def engine_has(field: str) -> bool:
    return field in SamplingParams.model_fields


def unsupported(param: str, value: Any, why: str) -> None:
    raise bad_request(f"{param}={value!r} is not supported by nanoplug: {why}", param=param, code="unsupported_parameter")


def check_completion(req: CompletionRequest) -> None:
    """Refuse what no engine setting can honour, before any work starts."""
    if req.best_of not in (None, 1) and req.best_of != (req.n or 1):
        unsupported("best_of", req.best_of, "leave it out (or equal to n); nanoplug returns every sample it draws")
    if req.suffix:
        unsupported("suffix", req.suffix, "insertion needs a fill-in-the-middle model; leave it out")
    if req.logprobs is not None and not engine_has("logprobs"):
        unsupported("logprobs", req.logprobs, "this engine's SamplingParams has no logprobs yet; leave it out")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 asks for no text; it is for scoring a prompt with echo=true (and logprobs)",
                          param="max_tokens")


def check_chat(req: ChatRequest) -> None:
    # tools, tool_choice and response_format: server/tools.py and server/structured.py
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.logprobs and not engine_has("logprobs"):
        unsupported("logprobs", True, "this engine's SamplingParams has no logprobs yet; leave it out")
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for part in message.content:
                if part.type != "text":
                    unsupported(f"messages.{i}.content", part.type, "only text parts are understood")


def sampling_params(req: _Sampling, max_tokens: int, choice: int, logprobs: int | None,
                    constraint: Any = None) -> SamplingParams:
    """The engine's SamplingParams for choice `choice` of the request (seeded choices get seed + choice);
    `constraint`: its StructuredOutputsParams (server/structured.py, server/tools.py), or None."""
    values: dict[str, Any] = {"max_tokens": max_tokens}
    if constraint is not None:
        values["structured_outputs"] = constraint
    if req.temperature is not None:
        values["temperature"] = req.temperature
    if req.top_p is not None:
        values["top_p"] = req.top_p
    if req.top_k is not None:
        values["top_k"] = max(req.top_k, 0)
    if req.min_p is not None:
        values["min_p"] = req.min_p
    if req.seed is not None:
        values["seed"] = req.seed + choice
    if req.stop is not None:
        values["stop"] = req.stop
    if req.stop_token_ids:
        values["stop_token_ids"] = req.stop_token_ids
    if req.ignore_eos:
        values["ignore_eos"] = True
    for param, (field, default) in ENGINE_FEATURES.items():
        value = getattr(req, param)
        if value is None or value == default:
            continue
        if not engine_has(field):
            unsupported(param, value, f"this engine's SamplingParams has no {field} yet; leave it out or send "
                        f"its default {default!r}")
        values[field] = {int(k): v for k, v in value.items()} if param == "logit_bias" else value
    if logprobs is not None:
        values["logprobs"] = logprobs
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        raise bad_request(f"{field}: {err['msg']}" if field else err["msg"], param=field, code="invalid_value") from exc
