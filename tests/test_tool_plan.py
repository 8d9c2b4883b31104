"""server/tools.py without a model: tool_choice parsing and its 400s, the grammar of required, named and auto
calls, each model format (Hermes, Llama 3 JSON, Mistral) recognised in text, and streamed deltas (split
anywhere) that add up to the whole answer."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from nanoplug.api import HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS, MISTRAL_TOOL_CALLS
from nanoplug.engine.chat_tools import for_template
from nanoplug.server.errors import APIError
from nanoplug.server.tools import ToolPlan

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g"}}


def req(tools=(F, G), tool_choice=None, parallel=None):
    return SimpleNamespace(tools=list(tools), tool_choice=tool_choice, parallel_tool_calls=parallel)


def test_tool_choice_forms_and_their_errors():
    assert ToolPlan.of(req(tools=()), None) is None
    assert ToolPlan.of(req(), HERMES_TOOL_CALLS).choice == "auto"
    plan = ToolPlan.of(req(tool_choice={"type": "function", "function": {"name": "g"}}), None)
    assert (plan.choice, plan.name) == ("named", "g")
    assert plan.constraint().json_schema == {"type": "object", "properties": {}}
    for bad, param in ((req(tool_choice={"function": {"name": "h"}}), "tool_choice"),
                       (req(tools=(), tool_choice="required"), "tool_choice"),
                       (req(tools=({"type": "function", "function": {}},)), "tools.0"),
                       (req(tool_choice="sometimes"), "tool_choice"),
                       (req(tool_choice="auto"), "tool_choice")):  # auto needs the model's format (None here)
        with pytest.raises(APIError) as exc:
            ToolPlan.of(bad, None)
        assert exc.value.body()["error"]["param"] == param


def test_required_is_a_list_of_calls_and_one_without_parallel_calls():
    schema = ToolPlan.of(req(tool_choice="required"), None).constraint().json_schema
    assert schema["minItems"] == 1 and "maxItems" not in schema and len(schema["items"]["anyOf"]) == 2
    assert ToolPlan.of(req(tool_choice="required", parallel=False), None).constraint().json_schema["maxItems"] == 1
    plan = ToolPlan.of(req(tool_choice="required"), None)
    content, calls = plan.calls('[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', "stop")
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"x": 1}'), ("g", "{}")]
    assert plan.calls('[{"name": "f", "argu', "length") is None


def test_auto_is_generated_under_the_formats_structural_tag_and_one_call_without_parallel_calls():
    plan = ToolPlan.of(req(), HERMES_TOOL_CALLS)
    tag = plan.constraint().structural_tag
    assert tag == HERMES_TOOL_CALLS.structural_tag(plan.tools, True) and not tag["stop_after_first"]
    assert [s["begin"] for s in tag["structures"]] == ['<tool_call>\n{"name": "f", "arguments": ',
                                                      '<tool_call>\n{"name": "g", "arguments": ']
    assert ToolPlan.of(req(parallel=False), HERMES_TOOL_CALLS).constraint().structural_tag["stop_after_first"]
    assert ToolPlan.of(req(tool_choice="none"), HERMES_TOOL_CALLS).constraint() is None


FORMATS = [HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS, MISTRAL_TOOL_CALLS]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("piece", [1, 3, 7, 10_000])
def test_auto_streams_content_then_calls_that_add_up_to_the_whole_answer(fmt, piece):
    prefix = "" if fmt.start_in_json else "Let me check.\n"
    answer = prefix + fmt.write([("f", {"x": 2, "s": fmt.start}), ("g", {})])
    plan = ToolPlan.of(req(), fmt)
    body = plan.rewrite({"choices": [{"message": {"content": answer}, "finish_reason": "stop"}]})
    whole = body["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == (prefix.strip() or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]] \
        == [("f", {"x": 2, "s": fmt.start}), ("g", {})]
    stream, content, calls, reason = plan.stream(), "", {}, None
    pieces = [answer[i:i + piece] for i in range(0, len(answer), piece)]
    for k, text in enumerate(pieces):
        deltas, reason = stream.feed(text, k == len(pieces) - 1, "stop")
        for d in deltas:
            content += d.get("content", "")
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    calls[tc["index"]] = [tc["function"]["name"], tc["function"]["arguments"]]
                else:
                    calls[tc["index"]][1] += tc["function"]["arguments"]
    assert reason == "tool_calls" and content.strip() == prefix.strip() and fmt.start not in content
    assert list(calls.values()) == [[c["function"]["name"], c["function"]["arguments"]]
                                    for c in whole["message"]["tool_calls"]]
    one = ToolPlan.of(req(parallel=False), fmt).rewrite({"choices": [{"message": {"content": answer},
                                                                      "finish_reason": "stop"}]})
    assert [c["function"]["name"] for c in one["choices"][0]["message"]["tool_calls"]] == ["f"]


def test_named_streams_argument_fragments_as_they_come():
    plan = ToolPlan.of(req(tool_choice={"type": "function", "function": {"name": "f"}}), None)
    stream = plan.stream()
    first, _ = stream.feed('{"x"', False, None)
    assert first[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"x"'}
    last, reason = stream.feed(": 3}", True, "stop")
    assert reason == "tool_calls" and last == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 3}"}}]}]


def test_a_template_without_tools_gets_them_in_a_system_message_and_calls_as_text():
    messages = [{"role": "user", "content": "x?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out, tools = for_template(messages, [F], "{{ messages }}", HERMES_TOOL_CALLS)
    assert tools is None and out[0]["role"] == "system" and json.dumps(F) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert out[3] == {"role": "tool", "content": "42"}
    native, tools = for_template(messages, [F], "{% for tool in tools %}{{ tool_call }}{% endfor %}", HERMES_TOOL_CALLS)
    assert tools == [F] and native[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
