"""The request bodies of the OpenAI API that the server reads, as pydantic models.

As OpenAI does, unknown fields are ignored (`extra="ignore"`), and `null` means "the default". Ranges
are checked here so a bad value is a 400 naming the field before any work starts; whether the engine
can honour a field at all is `sampling.py`'s business. Extra fields vLLM accepts (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`) are read too: the OpenAI client sends them
through `extra_body`.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and the engine's
# list lengths refused before the rest of the body is validated (a 1 MB list of prompts takes pydantic seconds,
# on the event loop); the server's own --max-prompts is checked after, in checks.py
MAX_LIST_ITEMS = 4096
MAX_PROMPT_TOKENS = 1 << 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Sampling(_Body):
    """The fields completions and chat share."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM's extra: -1 or 0 keeps every token")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # output constraints (server/structured.py): vLLM's structured_outputs and its older guided_* extras
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys are token ids as strings, e.g. {{\"50256\": -100}}; got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases lie in [-100, 100]; got {bias} for token {key}")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptForm = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: PromptForm
    max_tokens: int | None = Field(16, ge=0, description="0 with echo: only the prompt (and its logprobs)")
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="vLLM's extra")
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        if isinstance(value, list) and value:
            flat = not isinstance(value[0], (str, list))
            limit = MAX_PROMPT_TOKENS if flat else MAX_LIST_ITEMS
            if len(value) > limit:
                raise ValueError(f"{len(value)} {'token ids' if flat else 'prompts'} are more than the {limit} "
                                 "one request may carry; split the request")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The message as plain text: text parts joined; any other part is refused by the caller."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_LIST_ITEMS)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
