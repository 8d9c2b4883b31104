"""What agent frameworks point at `nanoplug serve` (the embedded default model): langchain-openai's
`with_structured_output` (a pydantic model, a JSON schema) and `bind_tools` (invoke and stream), and litellm's
`completion` with tools (streamed and not). Calls always parse; the streamed arguments concatenate to the
non-streamed ones (temperature 0)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from _server import ServerProcess

pytestmark = pytest.mark.slow
ENGINE = dict(kv_block_size=64, num_kv_blocks=48, max_model_len=1024, max_num_seqs=4)
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
ASK = "What is the weather in Paris right now?"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int


@pytest.fixture(scope="module")
def server():
    from nanoplug.checkpoint.default_model import default_model_path

    proc = ServerProcess(model=str(default_model_path(progress=True)), engine=ENGINE, timeout=600)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI

    name = server.client().models.list().data[0].id
    return ChatOpenAI(model=name, base_url=f"{server.url}/v1", api_key=server.api_key, temperature=0, max_tokens=60,
                      max_retries=0, timeout=300)


def test_langchain_with_structured_output_of_a_pydantic_model_and_of_a_json_schema(chat_model):
    person = chat_model.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person)
    schema = {"title": "person", "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                                  "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    value = chat_model.with_structured_output(schema, method="json_schema").invoke("Describe a person.")
    jsonschema.validate(value, schema)


def test_langchain_bind_tools_invoke_and_stream_give_the_same_call(chat_model):
    bound = chat_model.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke(ASK)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER_PARAMS)
    whole = None
    for chunk in bound.stream(ASK):
        whole = chunk if whole is None else whole + chunk
    (streamed,) = whole.tool_calls
    assert (streamed["name"], streamed["args"]) == (call["name"], call["args"])
    assert json.loads("".join(c["args"] for c in whole.tool_call_chunks)) == call["args"]  # the fragments add up


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_litellm_completion_with_tools_streamed_and_not(server, tool_choice):
    import litellm

    kw = dict(model="openai/" + server.client().models.list().data[0].id, api_base=f"{server.url}/v1",
              api_key=server.api_key, messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
              tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_tokens=80)
    whole = litellm.completion(**kw).choices[0]
    calls = whole.message.tool_calls or []
    args, names, content, reason = {}, {}, "", None
    for chunk in litellm.completion(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            names[tc.index] = tc.function.name or names.get(tc.index)
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        reason = chunk.choices[0].finish_reason or reason
    if tool_choice == "required" or calls:  # auto: this small model may answer in text instead
        assert whole.finish_reason == "tool_calls" == reason and len(calls) == 1
        assert [(names[i], args[i]) for i in sorted(args)] == [(c.function.name, c.function.arguments) for c in calls]
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_PARAMS)
    else:
        assert whole.finish_reason == reason and content == whole.message.content and not args
