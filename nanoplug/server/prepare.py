"""Turning one HTTP request's prompts into engine requests: the chat template, tokenizing, the checks.

It runs wherever the EngineCore lives (a helper thread of the server, or of the engine process) and
never on the event loop. Every prompt of a request is checked before any is queued, so a bad one
never leaves its siblings running.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

from nanoplug.config import SamplingParams
from nanoplug.errors import RequestError

Prompt = Union[str, list[int], list[dict], dict]  # text, token ids, chat messages, or {"messages", "tools"}
# one prompt and each of its choices: (engine request id, SamplingParams)
PromptChoices = tuple[Prompt, list[tuple[str, SamplingParams]]]


def prepare_all(core: Any, items: list[PromptChoices], fill_context: bool) -> list[Any]:
    """The EngineRequests for every choice of every prompt, in order; raises RequestError.

    `fill_context`: max_tokens is the rest of the context (chat without max_tokens, as vLLM does)."""
    limit = core.config.max_model_len
    requests = []
    for index, (prompt, choices) in enumerate(items):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = core.chat_prompt_ids(prompt)
        elif isinstance(prompt, dict):  # a conversation with tools (server/tools.py)
            prompt = core.chat_prompt_ids(prompt["messages"], prompt.get("tools"))
        first_id, params = choices[0]
        if fill_context and isinstance(prompt, list):
            params = params.model_copy(update={"max_tokens": max(1, limit - len(prompt))})
        first = core.make_request(prompt, params, first_id)
        n = len(first.prompt_token_ids)
        if n + first.params.max_tokens > limit:
            where = f"prompt {index}" if len(items) > 1 else "the prompt"
            raise RequestError(
                f"{where} has {n} tokens and max_tokens is {first.params.max_tokens}: {n + first.params.max_tokens} "
                f"in all, but the model's context (max_model_len) is {limit} tokens; ask for at most "
                f"{max(limit - n, 0)} new tokens, or shorten the prompt")
        requests.append(first)
        for request_id, p in choices[1:]:  # more samples of the same prompt: tokenized once
            if fill_context:
                p = p.model_copy(update={"max_tokens": first.params.max_tokens})
            requests.append(dataclasses.replace(first, request_id=request_id, params=p))
    return requests
