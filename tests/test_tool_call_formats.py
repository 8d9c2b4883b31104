"""Tool-call formats (nanoplug/api/tool_calls.py): each format reads back what it writes (arguments holding the
format's own markers, nested JSON, several calls, text around them), reads what a real chat template writes, is
picked by the marker a chat template holds, and its structural tag admits exactly its own calls."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from nanoplug.api import HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS, MISTRAL_TOOL_CALLS, pick_tool_call_format
from nanoplug.config import StructuredOutputsParams

FORMATS = [HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS, MISTRAL_TOOL_CALLS]
QWEN_TEMPLATE = (Path(__file__).parent / "data" / "chat_templates" / "qwen2.5.jinja").read_text()  # Qwen3's own
# the parts of Llama 3.1's and Mistral's (v3 tokenizer) templates that write tool calls, as they ship
LLAMA31_TEMPLATE = (
    "{{- bos_token }}{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
    "{%- for message in messages %}{%- if 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}"
    "{%- else %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- \"}\" }}{%- endif %}{{- \"<|eot_id|>\" }}{%- endif %}{%- endfor %}")
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message.tool_calls is defined %}{{- \"[TOOL_CALLS][\" }}"
    "{%- for tool_call in message.tool_calls %}{%- set arguments = tool_call.function.arguments | tojson %}"
    "{{- '{\"name\": \"' + tool_call.function.name + '\", \"arguments\": ' + arguments + '}' }}"
    "{%- if not loop.last %}{{- \", \" }}{%- endif %}{%- endfor %}{{- \"]\" + eos_token }}{%- endif %}{%- endfor %}")
SMOLLM2_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
                    "+ '<|im_end|>' + '\\n'}}{% endfor %}")

# arguments that hold every format's markers, nested objects and lists, quotes and unicode
TRICKY = {"query": "<tool_call>{\"name\": \"x\"}</tool_call> [TOOL_CALLS][{}] ; {\"name\": ",
          "filters": {"tags": ["a", {"deep": [1, 2.5, None, True]}], "quote": "\"}\n"}, "city": "Zürich"}
CALLS = [("search", TRICKY), ("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]


def render(template: str, messages: list[dict]) -> str:
    """A chat template rendered as transformers renders it (its `tojson` is json.dumps, not jinja's HTML-safe one)."""
    env = jinja2.Environment()
    env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
    return env.from_string(template).render(messages=messages, bos_token="", eos_token="</s>")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("calls", [CALLS[:1], CALLS[1:2], CALLS], ids=["tricky", "plain", "three"])
def test_each_format_reads_back_what_it_writes(fmt, calls):
    written = fmt.write(calls)
    assert fmt.parse(written) == ("", calls)
    if not fmt.start_in_json:  # text before a call stays content (a Llama 3 answer is the calls alone)
        assert fmt.parse("Let me look that up.\n" + written) == ("Let me look that up.", calls)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_text_without_a_complete_call_is_content(fmt):
    assert fmt.parse("The weather is fine; no call needed.") is None
    assert fmt.parse(fmt.write(CALLS[1:2]).split("3}")[0]) is None  # cut off inside the JSON (max_tokens)


def test_hermes_reads_the_calls_qwens_own_template_writes():
    calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS]
    text = render(QWEN_TEMPLATE, [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "", "tool_calls": calls}])
    answer = text.split("<|im_start|>assistant\n<think>\n\n</think>\n\n", 1)[1].rsplit("<|im_end|>", 1)[0]
    assert HERMES_TOOL_CALLS.parse(answer) == ("", CALLS)


@pytest.mark.parametrize("template, fmt", [(LLAMA31_TEMPLATE, LLAMA3_JSON_TOOL_CALLS),
                                           (MISTRAL_TEMPLATE, MISTRAL_TOOL_CALLS)], ids=["llama3.1", "mistral"])
def test_llama_and_mistral_read_the_calls_their_templates_write(template, fmt):
    calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in CALLS]
    one = calls[1:2] if fmt is LLAMA3_JSON_TOOL_CALLS else calls  # Llama 3.1's template writes one call a turn
    text = render(template, [{"role": "assistant", "content": "", "tool_calls": one}])
    text = text.split("<|end_header_id|>\n\n", 1)[-1].replace("<|eot_id|>", "").replace("</s>", "")
    assert fmt.parse(text) == ("", [(c["function"]["name"], c["function"]["arguments"]) for c in one])


@pytest.mark.parametrize("formats, template, expected", [
    ((HERMES_TOOL_CALLS,), QWEN_TEMPLATE, HERMES_TOOL_CALLS),  # Qwen2/3
    ((HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS), LLAMA31_TEMPLATE, LLAMA3_JSON_TOOL_CALLS),  # Llama 3.1
    ((HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS), SMOLLM2_TEMPLATE, HERMES_TOOL_CALLS),  # SmolLM2: no marker, first
    ((MISTRAL_TOOL_CALLS, HERMES_TOOL_CALLS), MISTRAL_TEMPLATE, MISTRAL_TOOL_CALLS),
    ((MISTRAL_TOOL_CALLS, HERMES_TOOL_CALLS), QWEN_TEMPLATE, HERMES_TOOL_CALLS),  # a Hermes fine-tune of Mistral
    ((), QWEN_TEMPLATE, None),  # a plugin that declares none
], ids=["qwen", "llama3.1", "smollm2", "mistral", "hermes-mistral", "none"])
def test_the_format_is_picked_by_the_marker_its_template_holds(formats, template, expected):
    assert pick_tool_call_format(formats, template) is expected


def test_the_model_plugins_declare_their_formats():
    from nanoplug.engine.registry import default_registry

    registry = default_registry()
    assert registry.get("model", "LlamaForCausalLM").tool_call_formats == (HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS)
    assert registry.get("model", "MistralForCausalLM").tool_call_formats[0] is MISTRAL_TOOL_CALLS
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert registry.get("model", arch).tool_call_formats == (HERMES_TOOL_CALLS,)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_formats_structural_tag_is_a_valid_constraint_with_one_structure_per_function(fmt):
    tag = fmt.structural_tag([WEATHER, SEARCH], parallel=False)
    constraint = StructuredOutputsParams(structural_tag=tag).constraint
    assert constraint.kind == "structural_tag" and json.loads(constraint.text)["stop_after_first"]
    assert len(tag["structures"]) == (1 if fmt.listed else 2)
    assert all(s["begin"].startswith(fmt.start) for s in tag["structures"])
    if not fmt.listed:  # the begin + arguments + end of each function is that function's call in the format
        s = tag["structures"][0]
        assert fmt.parse(s["begin"] + '{"city": "Oslo", "days": 2}' + s["end"]) == \
            ("", [("get_weather", {"city": "Oslo", "days": 2})])
    assert fmt.structural_tag([WEATHER])["stop_after_first"] is fmt.listed  # parallel: many calls (one list)


@pytest.mark.parametrize("bad, why", [
    ({"triggers": [], "structures": [{"begin": "<a>"}]}, "structural_tag must be"),
    ({"triggers": ["<b>"], "structures": [{"begin": "<a>", "schema": {}}]}, "starts with none of the triggers"),
    ("{not json", "not JSON"),
])
def test_a_bad_structural_tag_names_what_is_wrong(bad, why):
    with pytest.raises(ValueError, match=why):
        StructuredOutputsParams(structural_tag=bad)


# ------------------------------------------------------------------ the structural tag through both backends
UNIT = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def few_shot(fmt) -> str:
    """A prompt the model continues with a call in `fmt` (examples it copies), in a unit the schema forbids."""
    shots = "".join(f"Q: Weather in {city}?\nA: I will look it up. {fmt.write([('get_weather', {'city': city, 'unit': 'kelvin'})])}\n"
                    for city in ("Oslo", "Lima", "Rome"))
    return shots + "Q: Weather in Paris?\nA:"


@pytest.fixture(scope="module")
def engines():
    from nanoplug import LLM
    from nanoplug.checkpoint.default_model import default_model_path

    options = dict(num_kv_blocks=16, kv_block_size=64, max_model_len=1024, max_num_seqs=4, cpu={"graphs": False})
    llms = {b: LLM(str(default_model_path(progress=True)), structured_output=b, **options)
            for b in ("xgrammar", "llguidance")}
    yield llms
    for llm in llms.values():
        llm.close()


@pytest.mark.slow
def test_a_triggered_call_validates_and_both_backends_draw_the_same_tokens(engines):
    import jsonschema

    from nanoplug import SamplingParams

    outs = {}
    for backend, llm in engines.items():
        params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs={
            "structural_tag": fmt.structural_tag([UNIT, SEARCH], parallel=False)}) for fmt in FORMATS]
        outs[backend] = [o.outputs[0] for o in llm.generate([few_shot(f) for f in FORMATS], params, use_tqdm=False)]
    for fmt, x, g in zip(FORMATS, outs["xgrammar"], outs["llguidance"]):
        if not fmt.listed:
            assert x.token_ids == g.token_ids, fmt.name
        # Mistral's list of anyOf items: xgrammar's output spells the key "argument" + "s" where llguidance's takes
        # the token "arguments" (seen 2026-12-03; why is open): the same calls, other tokens
        for out in (x, g):
            assert out.finish_reason == "stop", (fmt.name, out.text)  # one call (stop_after_first), then the end
            content, calls = fmt.parse(out.text)
            assert len(calls) == 1 and calls[0][0] == "get_weather", (fmt.name, out.text)
            jsonschema.validate(calls[0][1], UNIT["function"]["parameters"])  # copied "kelvin" would not validate
            assert content and out.text.index(fmt.start) > 0  # free text first, then the triggered call
        assert fmt.parse(x.text) == fmt.parse(g.text)
