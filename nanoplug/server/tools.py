"""Tool calling for chat: `tools`, `tool_choice` (none, auto, required, a named function) and
`parallel_tool_calls`, the answer's `tool_calls` with finish_reason "tool_calls", and their stream deltas as
OpenAI sends them (per call: its id, type and name with empty arguments first, then argument fragments).

With "required" or a named function the call is generated under a JSON-schema constraint built from the
functions' parameter schemas, so it always parses: "required" writes a JSON list of {"name", "arguments"}
objects (one at most without parallel calls; vLLM's shape), a named function writes its arguments object
alone. With "auto" the model writes calls in its own format, the one its model plugin declares and its chat template
writes (`ModelArchitecture.tool_call_formats`: Hermes' `<tool_call>{...}</tool_call>`, Llama 3's bare JSON,
Mistral's `[TOOL_CALLS][...]`), recognised in its text; the answer is generated under that format's structural
tag built from the functions' schemas (free text until a call starts, then a call of one of the functions, one
at most without parallel calls), so a call it starts always completes and parses too.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from nanoplug.api import ToolCallFormat, pick_tool_call_format
from nanoplug.config import StructuredOutputsParams
from nanoplug.server.errors import bad_request


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(name: str, arguments: str) -> dict:
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


@dataclass
class ToolPlan:
    """What one chat request's tools ask of the engine and of its answer."""

    tools: list[dict]  # the functions, as the chat template takes them ({"type": "function", "function": {...}})
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True
    fmt: ToolCallFormat | None = None

    @classmethod
    def of(cls, req: Any, fmt: ToolCallFormat | None) -> "ToolPlan | None":
        """The request's plan, or None without tools; a 400 naming the field for a bad one."""
        tools, choice = req.tools or [], req.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise bad_request(f"tool_choice={choice!r} needs tools; give the functions in tools",
                                  param="tool_choice", code="invalid_value")
            return None
        names = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                  "\"parameters\": {...}}}", param=f"tools.{i}", code="invalid_value")
            if not isinstance(fn.get("parameters", {}), dict):
                raise bad_request(f"tools.{i}.function.parameters must be a JSON schema object",
                                  param=f"tools.{i}.function.parameters", code="invalid_value")
            names.append(fn["name"])
        plan = cls([{"type": "function", "function": t["function"]} for t in tools], "auto",
                   parallel=req.parallel_tool_calls is not False, fmt=fmt)
        if choice is None or choice in ("auto", "none", "required"):
            plan.choice = choice or "auto"
        elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
            plan.choice, plan.name = "named", choice["function"]["name"]
            if plan.name not in names:
                raise bad_request(f"tool_choice names {plan.name!r}, which is not among the tools "
                                  f"({', '.join(names)})", param="tool_choice", code="invalid_value")
        else:
            raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
        if plan.choice == "auto" and fmt is None:
            raise bad_request("this model declares no tool-call format, so tool_choice \"auto\" cannot recognise its "
                              "calls; use tool_choice \"required\" or a named function (generated under a grammar)",
                              param="tool_choice", code="unsupported_parameter")
        return plan

    def _parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar the answer is generated under: required and named calls always parse, and so does a call
        the model starts under "auto" (free text until its format's start, then one of the functions' calls)."""
        if self.choice == "auto":
            return StructuredOutputsParams(structural_tag=self.fmt.structural_tag(self.tools, self.parallel))
        if self.choice == "named":
            return StructuredOutputsParams(json=self._parameters(self.name))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": self._parameters(t["function"]["name"])},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def calls(self, text: str, reason: str | None) -> tuple[str | None, list[dict]] | None:
        """(content, tool_calls) of a finished answer, or None when it holds no call (plain content)."""
        if self.choice == "none" or reason != "stop":
            return None
        if self.choice == "named":
            return None, [_tool_call(self.name, text)]
        if self.choice == "required":
            try:
                calls = json.loads(text)
            except ValueError:
                return None
            return None, [_tool_call(c["name"], _arguments_text(c["arguments"])) for c in calls]
        parsed = self.fmt.parse(text)
        if parsed is None:
            return None
        content, calls = parsed
        if not self.parallel:
            calls = calls[:1]
        return content or None, [_tool_call(name, _arguments_text(args)) for name, args in calls]

    def rewrite(self, body: dict) -> dict:
        """The whole (not streamed) answer with each choice's calls in `tool_calls`."""
        for choice in body["choices"]:
            message = choice["message"]
            found = self.calls(message["content"], choice["finish_reason"])
            if found is not None:
                message["content"], message["tool_calls"] = found
                choice["finish_reason"] = "tool_calls"
        return body

    def stream(self) -> "ToolStream":
        return ToolStream(self)


@dataclass
class ToolStream:
    """One streamed choice: content deltas pass through until a call may begin; calls come as OpenAI's deltas."""

    plan: ToolPlan
    held: str = ""  # text not sent yet (a call, or what may be the start of one)
    started: bool = False  # named: the call's header was sent
    sent_args: list[str] = field(default_factory=list)

    def feed(self, text: str, finished: bool, reason: str | None) -> tuple[list[dict], str | None]:
        """The chat deltas to send for this piece of text, and the finish reason to send with the last."""
        plan = self.plan
        out: list[dict] = []
        if plan.choice == "none":
            return ([{"content": text}] if text else []), reason
        if plan.choice == "named":  # the text is the arguments: fragments as they come
            if not self.started:
                self.started = True
                call = _tool_call(plan.name, "")
                out.append({"tool_calls": [{"index": 0, **call}]})
            if text:
                self.sent_args.append(text)
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out, ("tool_calls" if finished and reason == "stop" else reason)
        self.held += text
        if plan.choice == "auto" and not finished:
            start = plan.fmt.start
            at = self.held.find(start)
            if at < 0:  # send all but a tail that may be the start tag's beginning
                keep = next((k for k in range(min(len(start) - 1, len(self.held)), 0, -1)
                             if start.startswith(self.held[-k:])), 0)
                send, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return ([{"content": send}] if send else []), None
            if at > 0 and not self.started:
                send, self.held = self.held[:at], self.held[at:]
                return [{"content": send}], None
            return [], None
        if not finished:
            return [], None
        found = plan.calls(self.held, reason)
        if found is None:
            return ([{"content": self.held}] if self.held else []), reason
        content, calls = found
        if content:
            out.append({"content": content})
        for i, call in enumerate(calls):
            args = call["function"]["arguments"]
            out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                        "function": {"name": call["function"]["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": args}}]})
        return out, "tool_calls"


def chat_messages(messages: list[Any], roles: dict[str, str]) -> list[dict]:
    """The conversation for the engine's chat template: text content, and the assistant's `tool_calls` and the
    tool messages' `tool_call_id` kept (the template renders them; engine/chat_tools.py for templates that
    know no tools)."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": roles.get(m.role, m.role), "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        out.append(message)
    return out


def model_tool_call_format(model: str, chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format checkpoint `model` writes: of its model plugin's formats, the one its chat template
    holds (the engine process's server side asks the registry, as the engine does), or None."""
    try:
        from nanoplug.checkpoint.loader import load_hf_config
        from nanoplug.checkpoint.source import resolve_model_path
        from nanoplug.engine.registry import default_registry

        arch = (getattr(load_hf_config(resolve_model_path(model)), "architectures", None) or [None])[0]
        formats = getattr(default_registry().get("model", arch), "tool_call_formats", ())
    except Exception:  # the engine process reports a bad checkpoint itself
        return None
    return pick_tool_call_format(formats, chat_template)
