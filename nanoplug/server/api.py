"""`POST /v1/completions` and `POST /v1/chat/completions`: request in, engine requests out, then one
JSON body or a server-sent-event stream ending in `data: [DONE]`.

Each choice (every prompt of a list, times `n`) is one engine request; they all join the engine's
continuous batch with everyone else's. A client that goes away, streaming or not, has its requests
aborted at once, which frees their KV blocks at the engine's next step.
"""
from __future__ import annotations

import asyncio
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from nanoplug.server.errors import APIError, bad_request
from nanoplug.server.protocol import ChatRequest, CompletionRequest
from nanoplug.server.render import Responder, encode, usage
from nanoplug.server.sampling import check_chat, check_completion, sampling_params
from nanoplug.server.streams import RequestStream, read
from nanoplug.server.structured import constraint_of
from nanoplug.server.tools import ToolPlan, chat_messages

CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


def check_model(state: Any, model: str | None) -> None:
    served = state.settings.model_name
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist here; this server serves {served!r} (GET /v1/models)",
                       param="model", code="model_not_found")


def add_routes(app: FastAPI, state: Any, auth: Any) -> None:
    @app.post("/v1/completions", dependencies=[auth])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(state, body.model)
        check_completion(body)
        prompts = body.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("the prompt is empty; give at least one token of text", param="prompt")
        if body.echo and any(not isinstance(p, str) for p in prompts):
            raise bad_request("echo works with text prompts only; send the prompt as a string", param="echo")
        n = body.n or 1
        constraint = constraint_of(body)
        responder = Responder(chat=False, model=state.settings.model_name, token_text=state.engine.token_text)
        items = [(prompt, [(f"{responder.id}-{i * n + j}", sampling_params(body, body.max_tokens or 16, j, body.logprobs,
                                                                           constraint))
                           for j in range(n)]) for i, prompt in enumerate(prompts)]
        echo = [p for p in prompts for _ in range(n)] if body.echo else None
        return await respond(state, request, responder, items, n, bool(body.stream), body.include_usage,
                             fill_context=False, echo=echo)

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(state, body.model)
        check_chat(body)
        n = body.n or 1
        max_tokens = body.max_completion_tokens or body.max_tokens
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
        responder = Responder(chat=True, model=state.settings.model_name, token_text=state.engine.token_text)
        items = [(prompt, [(f"{responder.id}-{j}", sampling_params(body, max_tokens or 1, j, logprobs, constraint))
                           for j in range(n)])]
        return await respond(state, request, responder, items, n, bool(body.stream), body.include_usage,
                             fill_context=max_tokens is None, plan=plan)


async def respond(state: Any, request: Request, responder: Responder, items: list, n: int, stream: bool,
                  include_usage: bool, fill_context: bool, echo: list[str] | None = None,
                  plan: ToolPlan | None = None) -> Response:
    with state.admit(sum(len(choices) for _, choices in items)):
        streams = await state.engine.submit(items, fill_context)
    if stream:
        events = _events(state, responder, streams, n, include_usage, echo, plan)
        return EventSourceResponse(events, shutdown_event=anyio.Event(),
                                   shutdown_grace_period=state.settings.shutdown_grace_s)
    collect = asyncio.ensure_future(_collect(streams, n, echo))
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
    texts, reasons, logprobs, usage_body = collect.result()  # raises the stream's APIError (shutdown, engine failure)
    body = responder.body(texts, reasons, logprobs, usage_body, echo)
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


async def _collect(streams: list[RequestStream], n: int, echo: list[str] | None):
    texts = [[e] if echo else [] for e in (echo or [None] * len(streams))]
    reasons: list[str | None] = [None] * len(streams)
    logprobs: list[list | None] = [None] * len(streams)
    counted = _Usage(len(streams), n)
    async for got in read(streams):
        for i, delta in got:
            texts[i].append(delta.text)
            counted.add(i, delta)
            if delta.logprobs is not None:
                logprobs[i] = (logprobs[i] or []) + delta.logprobs
            if delta.finished:
                reasons[i] = delta.finish_reason
    return ["".join(t) for t in texts], reasons, logprobs, counted.body()


async def _events(state: Any, responder: Responder, streams: list[RequestStream], n: int, include_usage: bool,
                  echo: list[str] | None, plan: ToolPlan | None = None):
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
