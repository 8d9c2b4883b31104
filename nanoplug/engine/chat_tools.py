"""A conversation with tools, made ready for the checkpoint's chat template.

A template that knows tools (it reads `tools`, e.g. Qwen's) gets them and the messages as OpenAI sends them,
the assistant's call arguments parsed into objects as templates expect. A template that knows none (SmolLM2's
plain ChatML) would drop the tools and fail on a message without text, so the functions are described in a
system message in the model's own tool-call format (of its model plugin's `tool_call_formats`), the assistant's
earlier calls are written in that format, and tool results are plain `tool` turns.
"""
from __future__ import annotations

import json
from typing import Any

from nanoplug.api import HERMES_TOOL_CALLS, ToolCallFormat


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_call" in template


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def tools_prompt(tools: list[dict], fmt: ToolCallFormat) -> str:
    """The functions and how to call them, as Hermes-style models are tuned to read (NousResearch's prompt),
    with the example call written in the model's own format."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = fmt.write([("<function-name>", {"<arg>": "<value>"})])
    where = f"within {fmt.start}{fmt.end.strip()} tags" if fmt.end else "in this form"
    return ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
            "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
            f"about what values to plug into functions.\n<tools>\n{listing}\n</tools>\nFor each function call "
            f"return a json object with function name and arguments {where}:\n{example}")


def for_template(messages: list[dict], tools: list[dict] | None, template: str | None,
                 fmt: ToolCallFormat | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render: as given to a template that knows tools, rewritten for one that does not."""
    if template_knows_tools(template):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                            "arguments": _arguments(c["function"].get("arguments"))}}
                                         for c in m["tool_calls"]]}
            out.append(m)
        return out, tools or None
    fmt = fmt or HERMES_TOOL_CALLS
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        m.pop("tool_call_id", None)
        m.pop("name", None)
        if calls:
            written = fmt.write([(c["function"]["name"], _arguments(c["function"].get("arguments"))) for c in calls])
            m["content"] = "\n".join(filter(None, [m.get("content") or "", written]))
        m["content"] = m.get("content") or ""
        out.append(m)
    if tools:
        system = tools_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None
