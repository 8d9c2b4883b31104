"""How a model writes tool calls in its own text, declared by its model plugin (never a table in the server).

A format can read calls out of a finished answer (`parse`), write earlier calls back into a conversation
(`write`), and describe its calls as a structural tag (`structural_tag`): free text until the format's
`start` appears, then one of the offered functions with arguments drawn under that function's parameter
schema. Under that constraint a call the model starts in tool_choice "auto" always parses.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


@dataclass(frozen=True)
class ToolCallFormat:
    """Each call is `start` + `gap` + a JSON object {name_key: ..., arguments_key: {...}} + `end`
    (Hermes/Qwen: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`). `listed`: after `start` comes
    one JSON list of such objects (Mistral: `[TOOL_CALLS][{...}, {...}]`). `start_in_json`: `start` is the
    object's own beginning (Llama 3: `{"name": ...`, calls separated by `separator`). `marker`: a string whose
    presence in a chat template says the template writes this format (`pick_tool_call_format`)."""

    name: str
    start: str
    end: str = ""
    name_key: str = "name"
    arguments_key: str = "arguments"
    gap: str = ""
    listed: bool = False
    start_in_json: bool = False
    separator: str = ""
    marker: str = ""

    # ------------------------------------------------------------------------------ reading
    def _object_at(self, begin: int) -> int:
        return begin if self.start_in_json else begin + len(self.start)

    def parse(self, text: str) -> tuple[str, list[tuple[str, Any]]] | None:
        """(the text outside the calls, [(function name, arguments)]), or None when no complete call parses."""
        calls: list[tuple[str, Any]] = []
        content, at = [], 0
        while (begin := text.find(self.start, at)) >= 0:
            try:
                value, stop = _DECODER.raw_decode(text, _skip_space(text, self._object_at(begin)))
            except ValueError:
                return None
            items = value if self.listed and isinstance(value, list) else [value]
            if not items or not all(isinstance(c, dict) and isinstance(c.get(self.name_key), str) for c in items):
                return None
            content.append(text[at:begin])
            calls += [(c[self.name_key], c.get(self.arguments_key, {})) for c in items]
            stop = _skip_space(text, stop)
            if self.end and text.startswith(self.end.strip(), stop):
                stop += len(self.end.strip())
            if self.separator and text.startswith(self.separator, _skip_space(text, stop)):
                stop = _skip_space(text, stop) + len(self.separator)
            at = stop
        if not calls:
            return None
        content.append(text[at:])
        return "".join(content).strip(), calls

    # ------------------------------------------------------------------------------ writing
    def _call(self, name: str, arguments: Any) -> dict:
        return {self.name_key: name, self.arguments_key: arguments}

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """Calls as the model writes them (earlier turns of a conversation, and the example in a tools prompt)."""
        if self.listed:
            body = json.dumps([self._call(n, a) for n, a in calls], ensure_ascii=False)
            return self.start + self.gap + body + self.end
        each = [json.dumps(self._call(n, a), ensure_ascii=False) for n, a in calls]
        if self.start_in_json:
            return (self.separator + " ").join(each) if self.separator else "\n".join(each)
        return "\n".join(self.start + self.gap + e + self.end for e in each)

    # --------------------------------------------------------------------------- constraining
    def structural_tag(self, tools: list[dict], parallel: bool = True) -> dict:
        """The structural tag (the `structural_tag` constraint's {"triggers", "structures"}) under which a call
        the model starts is one of `tools` ({"type": "function", "function": {...}}) with arguments that fit; one call
        at most unless `parallel` (a listed format writes one list, of one call at most unless `parallel`)."""
        def parameters(fn: dict) -> dict:
            return fn.get("parameters") or {"type": "object", "properties": {}}

        functions = [t["function"] for t in tools]
        if self.listed:  # one list of calls after the start: its items are the functions' calls
            items = [{"type": "object", "properties": {self.name_key: {"const": f["name"]},
                                                       self.arguments_key: parameters(f)},
                      "required": [self.name_key, self.arguments_key], "additionalProperties": False}
                     for f in functions]
            schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                                      "minItems": 1}
            if not parallel:
                schema["maxItems"] = 1
            structures = [{"begin": self.start + self.gap, "schema": schema, "end": self.end}]
            return {"triggers": [self.start], "structures": structures, "stop_after_first": True}
        structures = []
        for f in functions:
            head = json.dumps({self.name_key: f["name"]}, ensure_ascii=False)[:-1]  # '{"name": "f"'
            begin = ("" if self.start_in_json else self.start + self.gap) + head + f', "{self.arguments_key}": '
            structures.append({"begin": begin, "schema": parameters(f), "end": "}" + self.end})
        return {"triggers": [self.start], "structures": structures, "stop_after_first": not parallel}


HERMES_TOOL_CALLS = ToolCallFormat("hermes", "<tool_call>", "\n</tool_call>", gap="\n", marker="<tool_call>")
"""NousResearch's Hermes format, which Qwen2/2.5/3 and SmolLM2 are tuned on."""

LLAMA3_JSON_TOOL_CALLS = ToolCallFormat("llama3_json", '{"name": ', arguments_key="parameters", start_in_json=True,
                                        separator=";", marker="<|python_tag|>")
"""Llama 3.1-3.3's JSON-based tool calling: the answer is `{"name": ..., "parameters": {...}}` (`;` between calls)."""

MISTRAL_TOOL_CALLS = ToolCallFormat("mistral", "[TOOL_CALLS]", listed=True, marker="[TOOL_CALLS]")
"""Mistral's (v3 tokenizer) format: `[TOOL_CALLS]` and then a JSON list of {"name", "arguments"} objects."""


def pick_tool_call_format(formats: tuple[ToolCallFormat, ...], chat_template: str | None) -> ToolCallFormat | None:
    """The format a checkpoint's chat template writes: the first of its model plugin's `formats` whose marker
    the template holds, else the plugin's first (a template that knows no tools gets it described), else None."""
    if not formats:
        return None
    template = chat_template or ""
    return next((f for f in formats if f.marker and f.marker in template), formats[0])
