"""The request API: prompt forms, outputs, stops, streaming, chat, the progress bar, and bad input
(rejected before any work starts, naming the prompt and the limit, with the engine serving on)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _checkpoints import PROMPTS, checkpoint, prompt_ids, scratch_dir, tokenizer
from _engine_checks import assert_idle, interrupt_generate
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import qwen_tokenizer_dir
from nanoplug.engine.detokenizer import IncrementalDetokenizer
from nanoplug.errors import RequestError

OPTIONS = dict(kv_block_size=16, attention="sdpa", kv_cache="torch", num_kv_blocks=64, max_model_len=256)
LONG = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint(), **OPTIONS)


@pytest.fixture(scope="module")
def greedy(llm):
    """Unconstrained greedy outputs of PROMPTS: what every stop test cuts."""
    return llm.generate(PROMPTS, LONG, use_tqdm=False)


# ------------------------------------------------------------------------------ prompt forms
def test_strings_and_token_ids_give_the_same_outputs_in_order(llm, greedy):
    ids = prompt_ids()
    from_ids = llm.generate(ids, LONG, use_tqdm=False)
    for i, (a, b) in enumerate(zip(greedy, from_ids)):
        assert a.index == b.index == i
        assert a.prompt == PROMPTS[i] and b.prompt is None
        assert a.prompt_token_ids == b.prompt_token_ids == ids[i]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 16
        assert a.text == b.text == tokenizer().decode(a.token_ids, skip_special_tokens=True)
        assert a.finish_reason == "length"


def test_a_single_prompt_and_one_params_per_prompt(llm, greedy):
    (one,) = llm.generate(PROMPTS[2], LONG, use_tqdm=False)
    assert one.token_ids == greedy[2].token_ids
    (one_ids,) = llm.generate(prompt_ids()[2], LONG, use_tqdm=False)  # a bare token-id list is one prompt
    assert one_ids.token_ids == greedy[2].token_ids
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 5, 9, 16)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [1, 5, 9, 16]
    assert all(o.token_ids == g.token_ids[: len(o.token_ids)] for o, g in zip(outs, greedy))
    assert llm.generate([], LONG, use_tqdm=False) == []


# ------------------------------------------------------------------------------------ stops
def test_stop_strings_cut_the_text_before_the_stop(llm, greedy):
    tok = tokenizer()
    checked = 0
    for g in greedy:
        ids, text = g.token_ids, g.text
        # a stop string that straddles the boundary between generated tokens 3 and 4 (when both have text)
        head = tok.decode(ids[:4], skip_special_tokens=True)
        if len(head) < 2 or len(text) < len(head) + 2:
            continue
        stop = head[-2:] + text[len(head):len(head) + 2]
        cut = text.find(stop)
        (out,) = llm.generate(g.prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
                              use_tqdm=False)
        assert out.finish_reason == "stop"
        assert out.text == text[:cut]
        assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) <= 5
        assert stop in tok.decode(out.token_ids, skip_special_tokens=True)
        checked += 1
    assert checked >= 2, "too few generated texts had a stop string to try"
    never = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["\x00zz"]),
                         use_tqdm=False)
    assert [(o.text, o.finish_reason) for o in never] == [(g.text, "length") for g in greedy]


def test_the_earliest_of_several_stop_strings_wins(llm, greedy):
    text = greedy[1].text
    first, later = text[3:5], text[len(text) - 3:]
    if text.find(later) <= text.find(first):
        pytest.fail(f"pick other stop strings for this text: {text!r}")
    (out,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                     stop=[later, first]), use_tqdm=False)
    assert out.text == text[: text.find(first)] and out.finish_reason == "stop"


def test_stop_token_ids_end_the_request_and_leave_the_text(llm, greedy):
    for g in greedy:
        stop_id = g.token_ids[4]
        first = g.token_ids.index(stop_id)
        (out,) = llm.generate(g.prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]),
                              use_tqdm=False)
        assert out.token_ids == g.token_ids[: first + 1]  # the stop token is in the ids ...
        assert out.text == tokenizer().decode(g.token_ids[:first], skip_special_tokens=True)  # ... not the text
        assert out.finish_reason == "stop"


def test_eos_ids_come_from_generation_config(llm, greedy):
    """A checkpoint whose generation_config.json names a token the model produces stops there."""
    g = greedy[0]
    eos = g.token_ids[3]
    folder = scratch_dir("eos_from_generation_config")
    for item in Path(checkpoint()).iterdir():  # the same weights and tokenizer, another generation config
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, eos]}))
    with LLM(str(folder), **OPTIONS) as custom:
        assert eos in custom.eos_token_ids and 151645 in custom.eos_token_ids
        (out,) = custom.generate(g.prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        first = g.token_ids.index(eos)
        assert out.token_ids == g.token_ids[: first + 1] and out.finish_reason == "stop"
        assert out.text == tokenizer().decode(g.token_ids[:first], skip_special_tokens=True)
        (ignored,) = custom.generate(g.prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                     use_tqdm=False)
        assert ignored.token_ids == g.token_ids and ignored.finish_reason == "length"


def test_max_model_len_ends_a_request_with_length():
    with LLM(checkpoint(), **dict(OPTIONS, max_model_len=32)) as small:
        ids = prompt_ids()[2]  # 24 tokens: room for 8 more
        (out,) = small.generate([ids], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
        assert len(out.token_ids) == 32 - len(ids) and out.finish_reason == "length"


# ---------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("stop", [[], ["zz\x00"]])
def test_stream_deltas_add_up_to_the_generate_output(llm, greedy, stop):
    for g in greedy:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop)
        deltas = list(llm.stream(g.prompt, params))
        assert "".join(d.text for d in deltas) == g.text
        assert [t for d in deltas for t in d.token_ids] == g.token_ids
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == "length"
    assert_idle(llm)


def test_stream_with_a_stop_string_matches_generate(llm, greedy):
    g = greedy[2]
    stop = g.text[len(g.text) // 2: len(g.text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    (out,) = llm.generate(g.prompt, params, use_tqdm=False)
    deltas = list(llm.stream(g.prompt, params))
    assert "".join(d.text for d in deltas) == out.text == g.text[: g.text.find(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_a_stream_left_early_frees_its_blocks(llm, greedy):
    stream = llm.stream(PROMPTS[0], LONG)
    next(stream), next(stream)
    stream.close()
    assert_idle(llm)
    assert llm.generate(PROMPTS, LONG, use_tqdm=False)[0].token_ids == greedy[0].token_ids


def test_incremental_detokenizer_holds_back_split_characters_and_flushes_at_the_end():
    tok = tokenizer()
    ids = tok.encode("\U0001d518\U0001d52b")  # two 4-byte characters, each split over two tokens
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok, [9707], [])
    detok.add(ids[0])
    assert detok.take(final=False) == ""  # half a character: nothing to show yet
    detok.add(ids[1])
    assert detok.take(final=False) == "\U0001d518"
    detok.add(ids[2])
    detok.flush()  # the request ended mid-character: show it as a full decode would
    assert detok.take(final=True) == tok.decode(ids[:3])[1:]


# --------------------------------------------------------------------------------------- chat
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
]


def test_chat_template_ids_equal_transformers_with_the_real_qwen3_tokenizer(llm):
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        want = real.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert llm.chat_prompt_ids(messages) == want
        assert want[-3:] == real.encode("<|im_start|>assistant\n")
    outs = llm.chat([CONVERSATION, CONVERSATION[1:2]], SamplingParams(temperature=0, max_tokens=4))
    assert [o.prompt_token_ids for o in outs] == [llm.chat_prompt_ids(CONVERSATION),
                                                 llm.chat_prompt_ids(CONVERSATION[1:2])]
    (single,) = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=4))
    assert single.token_ids == outs[0].token_ids


# ------------------------------------------------------------------------------- progress bar
def test_progress_bar_shows_prefill_and_decode_throughput(llm, capsys):
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Generating" in err and "4/4" in err
    assert "prefill" in err and "decode" in err and "tok/s" in err
    llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------- bad input
BAD_INPUT = {
    "too long": ([PROMPTS[0], list(range(1, 257))], r"prompt 1 has 256 tokens, but max_model_len is 256"),
    "empty string": (["", PROMPTS[0]], r"prompt 0 is empty"),
    "empty ids": ([PROMPTS[0], PROMPTS[1], []], r"prompt 2 is empty"),
    "id past the vocabulary": ([PROMPTS[0], [1, 2, 151669]], r"prompt 1 has token id 151669 outside the vocabulary \[0, 151669\)"),
    "negative id": ([[5, -1]], r"prompt 0 has token id -1 outside the vocabulary"),
    "not a prompt": ([PROMPTS[0], 3.5], r"prompt 1 is a float; give a string or a list of token ids"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_rejected_before_any_work_and_the_engine_serves_on(llm, greedy, case):
    prompts, message = BAD_INPUT[case]
    with pytest.raises(RequestError, match=message):
        llm.generate(prompts, LONG, use_tqdm=False)
    assert_idle(llm)
    with pytest.raises(RequestError, match=message.replace("prompt 1", "prompt 0").replace("prompt 2", "prompt 0")):
        next(llm.stream(prompts[-1] if case != "empty string" else prompts[0], LONG))
    assert_idle(llm)
    outs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert [o.token_ids for o in outs] == [g.token_ids for g in greedy]


def test_too_long_prompt_message_names_the_fix(llm):
    with pytest.raises(RequestError, match="shorten the prompt or raise max_model_len"):
        llm.generate([list(range(1, 300))], LONG, use_tqdm=False)


def test_a_wrong_number_of_sampling_params_is_rejected(llm):
    with pytest.raises(RequestError, match="got 2 SamplingParams for 4 prompts"):
        llm.generate(PROMPTS, [LONG, LONG], use_tqdm=False)
    assert_idle(llm)


def test_outputs_after_bad_input_equal_a_fresh_engine():
    with LLM(checkpoint(), **OPTIONS) as used:
        with pytest.raises(RequestError):
            used.generate([PROMPTS[0], ""], LONG, use_tqdm=False)
        after = used.generate(PROMPTS, LONG, use_tqdm=False)
    with LLM(checkpoint(), **OPTIONS) as fresh:
        assert [o.token_ids for o in after] == [o.token_ids for o in fresh.generate(PROMPTS, LONG, use_tqdm=False)]


def test_a_generate_interrupted_mid_run_leaves_nothing_behind(llm, greedy):
    interrupt_generate(llm, 3, PROMPTS, LONG)
    assert_idle(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, LONG, use_tqdm=False)] == [g.token_ids for g in greedy]
