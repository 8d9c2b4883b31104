"""`POST /v1/completions` and `POST /v1/chat/completions`: request in, engine requests out, then one
JSON body or a server-sent-event stream ending in `data: [DONE]`.

Each choice (every prompt of a list, times `n`) is one engine request; they all join the engine's
continuous batch with everyone else's. A client that goes away, streaming or not, has its requests
aborted at once, which frees their KV blocks at the engine's next step.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse

from nanoplug.engine.switching import switching_fast
from nanoplug.server.checks import check_request, check_token_prompts
from nanoplug.server.errors import APIError, bad_request, validation_error
from nanoplug.server.protocol import ChatRequest, CompletionRequest
from nanoplug.server.render import (Responder, completion_logprobs, encode, prompt_entries, usage,
                                    vllm_prompt_logprobs)
from nanoplug.server.sampling import check_chat, check_completion, sampling_params
from nanoplug.server.streams import RequestStream, read
from nanoplug.server.structured import constraint_of
from nanoplug.server.tools import ToolPlan, chat_messages

CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


def check_model(state: Any, model: str | None) -> str | None:
    """The per-request adapter `model` names (None: the base model), or a 404 listing the served names."""
    settings = state.settings
    if model is None or model == settings.model_name:
        return None
    if model in state.adapters:
        return model
    served = ", ".join(repr(m) for m in [settings.model_name, *state.adapters])
    raise APIError(404, f"the model {model!r} does not exist here; this server serves {served} (GET /v1/models)",
                   param="model", code="model_not_found")


def _with_adapter(params: Any, adapter: str | None) -> Any:
    return params if adapter is None else params.model_copy(update={"adapter": adapter})


LARGE_BODY = 256 << 10  # bytes: a body this large is planned with the GIL changing hands often (switching_fast)
SPLIT_PARSE = 1 << 20  # bytes: from here parsed in two shorter holds of the GIL (decode, then validate)


def add_routes(app: FastAPI, state: Any) -> None:
    """Parsing, the checks and the per-choice work run in a worker thread: a large body never holds up
    the event loop (/health, other streams) while it is admitted."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(state, request, *await _off_the_loop(_plan_completion, state, await request.body()))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await respond(state, request, *await _off_the_loop(_plan_chat, state, await request.body()))


async def _off_the_loop(plan: Any, state: Any, raw: bytes) -> tuple:
    """`plan(state, raw)` on a worker thread. The event loop still needs the GIL for each small task (a /health
    answer takes several): behind a thread planning a 4 MB body, each of those waits would be CPython's 5 ms."""
    if len(raw) < LARGE_BODY:
        return await anyio.to_thread.run_sync(plan, state, raw)

    def planned() -> tuple:
        with switching_fast():
            return plan(state, raw)

    return await anyio.to_thread.run_sync(planned)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object, e.g. {\"prompt\": \"Hello\"}",
                          code="invalid_json")
    if len(raw) >= SPLIT_PARSE:
        # pydantic's JSON validation of megabytes of token ids holds the GIL 40-70 ms in one call; msgspec's decode
        # and pydantic's validation of the objects hold it about 25 and 15. What msgspec refuses (a lone
        # surrogate, an integer past 64 bits, NaN) takes the path below, which words the error.
        try:
            decoded = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            pass
        else:
            try:
                return model.model_validate(decoded)
            except ValidationError as exc:
                raise validation_error(exc.errors(include_url=False)) from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    if errors[0].get("type") == "json_invalid":  # Python's parser takes what pydantic's refuses (a lone
        try:  # surrogate, "\ud800"): the checks then name the field that carries it
            return model.model_validate(json.loads(raw))
        except json.JSONDecodeError:
            pass
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
    raise validation_error(errors)


def _plan_completion(state: Any, raw: bytes) -> tuple:
    """`respond`'s arguments for a completions body; raises APIError."""
    body = _parse(CompletionRequest, raw)
    adapter = check_model(state, body.model)
    check_completion(body)
    prompts = body.prompts()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("the prompt is empty; give at least one token of text", param="prompt")
    engine = state.engine
    check_request(body, engine, state.capacity, len(prompts), state.settings.max_prompts, body.max_tokens)
    check_token_prompts(prompts, engine.vocab_size)
    n = body.n or 1
    # max_tokens 0 (lm-eval's scoring with echo): one token is drawn and left out of the answer
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    echo_logprobs = bool(body.echo) and body.logprobs is not None
    if body.stream and (echo_logprobs or body.prompt_logprobs is not None):
        raise bad_request("the prompt's logprobs (echo with logprobs, prompt_logprobs) come in a whole response; "
                          "send stream=false", param="stream")
    constraint = constraint_of(body)
    responder = Responder(chat=False, model=adapter or state.settings.model_name, token_text=engine.token_text)
    params = _with_adapter(sampling_params(body, max(max_tokens, 1), 0, body.logprobs, constraint), adapter)
    plp = body.prompt_logprobs if body.prompt_logprobs is not None else body.logprobs if echo_logprobs else None
    if plp is not None:
        params = params.model_copy(update={"prompt_logprobs": plp})
    choice = [params if body.seed is None else params.model_copy(update={"seed": body.seed + j}) for j in range(n)]
    items = [(prompt, [(f"{responder.id}-{i * n + j}", choice[j]) for j in range(n)])
             for i, prompt in enumerate(prompts)]
    echo = [p for p in prompts for _ in range(n)] if body.echo else None
    shape = Shape(echo=echo, drop_output=max_tokens == 0, echo_logprobs=echo_logprobs,
                  prompt_logprobs=body.prompt_logprobs is not None)
    return responder, items, n, bool(body.stream), body.include_usage, False, shape


def _plan_chat(state: Any, raw: bytes) -> tuple:
    """`respond`'s arguments for a chat body; raises APIError."""
    body = _parse(ChatRequest, raw)
    adapter = check_model(state, body.model)
    check_chat(body)
    n = body.n or 1
    max_tokens = body.max_completion_tokens or body.max_tokens
    check_request(body, state.engine, state.capacity, 1, 1, max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = chat_messages(body.messages, CHAT_ROLES)
    plan = ToolPlan.of(body, getattr(state.engine, "tool_call_format", None))
    constraint = constraint_of(body)
    if plan is not None and plan.constraint() is not None:
        if constraint is not None:
            raise bad_request(f"tool_choice={body.tool_choice!r} generates the call under its own grammar; "
                              "leave out response_format (or the other constraint)", param="tool_choice")
        constraint = plan.constraint()
    prompt = {"messages": messages, "tools": plan.tools} if plan is not None else messages
    responder = Responder(chat=True, model=adapter or state.settings.model_name, token_text=state.engine.token_text)
    params = _with_adapter(sampling_params(body, max_tokens or 1, 0, logprobs, constraint), adapter)
    items = [(prompt, [(f"{responder.id}-{j}", params if body.seed is None else
                        params.model_copy(update={"seed": body.seed + j})) for j in range(n)])]
    return responder, items, n, bool(body.stream), body.include_usage, max_tokens is None, None, plan


@dataclass
class Shape:
    """How a completion's answer is written beyond its text: echo, and the prompt's logprobs."""

    echo: list[Any] | None = None  # each choice's prompt (text or token ids), when echoed
    drop_output: bool = False  # max_tokens 0: the drawn token is left out
    echo_logprobs: bool = False  # logprobs cover the prompt's tokens too (echo with logprobs)
    prompt_logprobs: bool = False  # vLLM's extra: `prompt_logprobs` in each choice

    @property
    def wants_prompt_ids(self) -> bool:
        return bool(self.echo) and (self.echo_logprobs or any(not isinstance(p, str) for p in self.echo))


def _echo_texts(state: Any, shape: Shape, streams: list[RequestStream]) -> list[str] | None:
    if not shape.echo:
        return None
    tokenizer = state.engine.tokenizer
    return [p if isinstance(p, str) else tokenizer.decode(s.prompt_token_ids) for p, s in zip(shape.echo, streams)]


async def respond(state: Any, request: Request, responder: Responder, items: list, n: int, stream: bool,
                  include_usage: bool, fill_context: bool, shape: Shape | None = None,
                  plan: ToolPlan | None = None) -> Response:
    shape = shape or Shape()
    with state.admit(sum(len(choices) for _, choices in items)):
        if shape.wants_prompt_ids:
            streams = await state.engine.submit(items, fill_context, want_prompt_ids=True)
        else:
            streams = await state.engine.submit(items, fill_context)
    echo = _echo_texts(state, shape, streams)
    if stream:
        events = _events(state, responder, streams, n, include_usage, echo, shape, plan)
        return EventSourceResponse(events, shutdown_event=anyio.Event(),
                                   shutdown_grace_period=state.settings.shutdown_grace_s)
    collect = asyncio.ensure_future(_collect(streams, n, echo, shape))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # the client went away (or the handler was cancelled): stop its work
            collect.cancel()
            _abort_unfinished(state, streams)
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)  # nobody is listening; the status shows in the logs and metrics
    texts, reasons, logprobs, prompt_lps, usage_body = collect.result()  # raises the stream's APIError (shutdown,
    body = responder.body(texts, reasons, logprobs, usage_body, echo)  # engine failure)
    if shape.echo_logprobs or shape.prompt_logprobs:
        for i, (choice, stream) in enumerate(zip(body["choices"], streams)):
            prompt = prompt_entries(stream.prompt_token_ids, prompt_lps[i])
            if shape.echo_logprobs:
                choice["logprobs"] = completion_logprobs(prompt + (logprobs[i] or []), responder.token_text, 0)
            if shape.prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps[i], responder.token_text)
    return JSONResponse(plan.rewrite(body) if plan is not None else body)


class _Usage:
    """Prompt tokens are counted once per prompt, completion tokens once per choice."""

    def __init__(self, num_streams: int, n: int):
        self.n = n
        self.prompt = [0] * (num_streams // n)
        self.cached = [0] * (num_streams // n)
        self.completion = 0

    def add(self, index: int, delta: Any) -> None:
        self.completion += len(delta.token_ids)
        self.prompt[index // self.n] = delta.num_prompt_tokens
        self.cached[index // self.n] = delta.num_cached_tokens

    def body(self) -> dict:
        return usage(sum(self.prompt), self.completion, sum(self.cached))


async def _collect(streams: list[RequestStream], n: int, echo: list[str] | None, shape: Shape):
    texts = [[e] if echo else [] for e in (echo or [None] * len(streams))]
    reasons: list[str | None] = [None] * len(streams)
    logprobs: list[list | None] = [None] * len(streams)
    prompt_lps: list[list | None] = [None] * len(streams)
    counted = _Usage(len(streams), n)
    async for got in read(streams):
        for i, delta in got:
            if delta.prompt_logprobs is not None:
                prompt_lps[i] = delta.prompt_logprobs
            if shape.drop_output:
                delta.token_ids, delta.text, delta.logprobs = [], "", None
            texts[i].append(delta.text)
            counted.add(i, delta)
            if delta.logprobs is not None:
                logprobs[i] = (logprobs[i] or []) + delta.logprobs
            if delta.finished:
                reasons[i] = delta.finish_reason
    return ["".join(t) for t in texts], reasons, logprobs, prompt_lps, counted.body()


async def _events(state: Any, responder: Responder, streams: list[RequestStream], n: int, include_usage: bool,
                  echo: list[str] | None, shape: Shape, plan: ToolPlan | None = None):
    """The SSE stream: one event per choice per read (what piled up since the last read, merged); with tools,
    the deltas each choice's ToolStream makes of its text."""
    counted = _Usage(len(streams), n)
    tool_streams = [plan.stream() for _ in streams] if plan is not None else None
    try:
        if responder.chat or echo:
            for i in range(len(streams)):
                yield responder.first_chunk(i, echo[i] if echo else "", include_usage)
        async for got in read(streams):
            for i, delta in got:
                if shape.drop_output:
                    delta.token_ids, delta.text, delta.logprobs = [], "", None
                counted.add(i, delta)
                if tool_streams is not None:
                    for chunk in responder.tool_chunks(i, *tool_streams[i].feed(delta.text, delta.finished,
                                                                               delta.finish_reason),
                                                       delta.finished, include_usage):
                        yield chunk
                elif delta.text or delta.finished or delta.logprobs:
                    yield responder.chunk(i, delta, include_usage)
        if include_usage:
            yield responder.usage_chunk(counted.body())
        yield "[DONE]"
    except APIError as exc:  # shutdown or engine failure: a final error event, as OpenAI streams end on errors
        yield encode(exc.body())
    finally:  # a client that disconnected lands here too (cancelled at its await, or closed at a yield)
        _abort_unfinished(state, streams)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _abort_unfinished(state: Any, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.finished:
            state.engine.abort(stream.request_id)
