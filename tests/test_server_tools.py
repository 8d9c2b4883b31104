"""Structured outputs and tool calls through `nanoplug serve` (the embedded default model, SmolLM2-135M), driven
by the official `openai` client: response_format json_object / json_schema, vLLM's extras, a bad schema as a
400, and tools with each tool_choice, streamed and not (the streamed arguments concatenate to the non-streamed
ones and parse), plus a conversation that carries an assistant's tool calls and the tool's answer."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from _server import ServerProcess

ENGINE = dict(kv_block_size=64, num_kv_blocks=48, max_model_len=1024, max_num_seqs=4)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    from nanoplug.checkpoint.default_model import default_model_path

    proc = ServerProcess(model=str(default_model_path(progress=True)), engine=ENGINE, timeout=600)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


def test_response_format_json_schema_and_json_object(client):
    out = client.chat.completions.create(model=None or client.models.list().data[0].id, messages=[
        {"role": "user", "content": "Describe a person as JSON."}], temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    out = client.chat.completions.create(model=out.model, messages=[
        {"role": "user", "content": 'Answer in JSON like {"answer": "..."}: what colour is the sky?'}],
        temperature=0, max_tokens=60, response_format={"type": "json_object"})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # (a small model may nest objects until max_tokens)
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_vllm_extras_on_completions_and_chat(client):
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="The answer is", max_tokens=10, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")
    out = client.chat.completions.create(model=model, messages=ASK, max_tokens=10, temperature=0,
                                         extra_body={"structured_outputs": {"regex": "[0-9]{2} degrees"}})
    assert out.choices[0].message.content.endswith(" degrees") and out.choices[0].finish_reason == "stop"


def test_a_bad_constraint_is_a_400_naming_it(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="cannot compile this regex"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5,
                                       extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="at most one"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, response_format={"type": "json_object"},
                                       extra_body={"guided_regex": "a"})
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def streamed(client, **kw) -> tuple[str, dict[int, dict], str | None]:
    """The content, the tool calls by index (id and name from their first delta, arguments concatenated) and the
    finish reason of a streamed chat answer; checks each call's first delta carries id, type and name."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_always_parse_streamed_or_not(client, tool_choice):
    # (one call: with parallel calls allowed, this 135M model repeats the same call until max_tokens)
    kw = dict(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
              temperature=0, max_tokens=120, parallel_tool_calls=False)
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    content, got, reason = streamed(client, **kw)
    assert reason == "tool_calls" and content == ""
    assert [(g["name"], g["arguments"]) for g in got.values()] == [(c.function.name, c.function.arguments)
                                                                    for c in calls]


def test_parallel_tool_calls_allow_several_calls(client):
    out = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=80,
                                         messages=[{"role": "user", "content": "Weather and time in Paris and Rome?"}],
                                         tools=[WEATHER, TIME], tool_choice="required")
    choice = out.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls and all(json.loads(c.function.arguments) for c in choice.message.tool_calls)
    else:  # this model may repeat calls until max_tokens: the answer is then the text so far, not calls
        assert choice.finish_reason == "length" and choice.message.content.startswith('[{"name": "get_')


def test_none_and_auto_answer_in_text_or_calls(client):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                         temperature=0, max_tokens=20)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    kw = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=80)
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    content, got, reason = streamed(client, **kw)
    if choice.message.tool_calls:  # the model's own <tool_call> format, recognised
        assert choice.finish_reason == "tool_calls" == reason
        assert [(g["name"], g["arguments"]) for g in got.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        for c in choice.message.tool_calls:
            json.loads(c.function.arguments)
    else:
        assert content == choice.message.content and not got


def test_a_conversation_with_tool_calls_and_results_is_rendered(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=history, tools=[WEATHER],
                                         temperature=0, max_tokens=30)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > 100  # the tools' description and the call and its result are in the prompt
