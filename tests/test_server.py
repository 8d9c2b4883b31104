"""`nanoplug serve` end to end: a real server process on 127.0.0.1, driven by the official `openai` client.

The reference for every greedy text is the engine itself (`LLM.generate` on the same checkpoint with
the same options, one prompt alone), which is in turn tested against transformers elsewhere.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from _checkpoints import PROMPTS, checkpoint
from _server import API_KEY, ENGINE, start_server
from nanoplug import LLM, SamplingParams
from nanoplug.config import SamplingParams as EngineSamplingParams

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(request):
    return start_server(request)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm():
    engine = LLM(checkpoint("qwen3"), **ENGINE)
    yield engine
    engine.close()


def greedy(llm: LLM, prompt, max_tokens: int, **params) -> object:
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, **params), use_tqdm=False)
    return out


# ------------------------------------------------------------------------------ the happy paths
def test_models_health_and_metrics(server, client):
    (model,) = client.models.list().data
    assert model.id == checkpoint("qwen3") and model.owned_by == "nanoplug"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    metrics = server.metrics()
    assert metrics["nanoplug_kv_blocks_total"] == ENGINE["num_kv_blocks"]
    for name in ("nanoplug_num_requests_running", "nanoplug_num_requests_waiting", "nanoplug_kv_blocks_used",
                 "nanoplug_prompt_tokens_total", "nanoplug_generation_tokens_total",
                 "nanoplug_time_to_first_token_seconds_count", "nanoplug_inter_token_latency_seconds_count"):
        assert name in metrics, name


def test_completion_is_the_engines_greedy_text_with_usage(client, llm):
    for prompt in PROMPTS:
        want = greedy(llm, prompt, 12)
        got = client.completions.create(model=checkpoint("qwen3"), prompt=prompt, max_tokens=12, temperature=0)
        (choice,) = got.choices
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        assert got.object == "text_completion" and got.id.startswith("cmpl-")


def test_prompt_forms_keep_their_order_and_n_gives_n_choices(client, llm):
    ids = llm.tokenizer.encode(PROMPTS[1])
    got = client.completions.create(model=checkpoint("qwen3"), prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=6,
                                    temperature=0, n=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for c in got.choices:
        assert c.text == greedy(llm, [PROMPTS[0], PROMPTS[2]][c.index // 2], 6).text
    from_ids = client.completions.create(model=checkpoint("qwen3"), prompt=ids, max_tokens=6, temperature=0)
    assert from_ids.choices[0].text == greedy(llm, PROMPTS[1], 6).text
    batch_ids = client.completions.create(model=checkpoint("qwen3"), prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert [c.text for c in batch_ids.choices] == [greedy(llm, ids, 4).text, greedy(llm, ids[:3], 4).text]
    # seeded sampling: choice i draws with seed + i, so the request is reproducible and its choices differ
    kw = dict(model=checkpoint("qwen3"), prompt=PROMPTS[3], max_tokens=8, temperature=1.0, seed=7, n=3)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    seeded = llm.generate([PROMPTS[3]], SamplingParams(temperature=1.0, max_tokens=8, seed=8), use_tqdm=False)
    assert first.choices[1].text == seeded[0].text


def test_echo_stop_and_vllm_extras(client, llm):
    want = greedy(llm, PROMPTS[0], 8)
    got = client.completions.create(model=checkpoint("qwen3"), prompt=PROMPTS[0], max_tokens=8, temperature=0, echo=True)
    assert got.choices[0].text == PROMPTS[0] + want.text
    stop = want.text[len(want.text) // 2:][:3]
    cut = client.completions.create(model=checkpoint("qwen3"), prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == want.text[:want.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    # fields vLLM adds, through the client's extra_body; and an unknown field is ignored, as OpenAI does
    extra = client.completions.create(model=checkpoint("qwen3"), prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                      extra_body={"top_k": 5, "ignore_eos": True, "not_a_field": [1, 2]})
    assert extra.choices[0].text == greedy(llm, PROMPTS[0], 8, top_k=5, ignore_eos=True).text


def test_chat_applies_the_template(client, llm):
    ids = llm.chat_prompt_ids(CHAT)
    want = greedy(llm, ids, 10)
    got = client.chat.completions.create(model=checkpoint("qwen3"), messages=CHAT, max_tokens=10, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids)
    newer = client.chat.completions.create(model=checkpoint("qwen3"), max_completion_tokens=10, temperature=0,
                                           messages=[{"role": "developer", "content": CHAT[0]["content"]},
                                                     {"role": "user", "content": [{"type": "text", "text": CHAT[1]["content"]}]}])
    assert newer.choices[0].message.content == want.text


def test_chat_without_max_tokens_may_fill_the_context(client, llm):
    ids = llm.chat_prompt_ids(CHAT)
    got = client.chat.completions.create(model=checkpoint("qwen3"), messages=CHAT, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == ENGINE["max_model_len"] - len(ids)
    assert got.choices[0].finish_reason == "length"


def _stream_text(stream) -> tuple[str, list[str | None], object]:
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            pieces.append(piece or "")
            reasons.append(choice.finish_reason)
    return "".join(pieces), reasons, usage


def test_streamed_text_equals_the_whole_text(client):
    for prompt in PROMPTS:
        whole = client.completions.create(model=checkpoint("qwen3"), prompt=prompt, max_tokens=20, temperature=0)
        text, reasons, usage = _stream_text(client.completions.create(
            model=checkpoint("qwen3"), prompt=prompt, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert text == whole.choices[0].text
        assert reasons[-1] == whole.choices[0].finish_reason and all(r is None for r in reasons[:-1])
        assert len(reasons) > 1
        assert usage.completion_tokens == whole.usage.completion_tokens
        assert usage.prompt_tokens == whole.usage.prompt_tokens
    whole = client.chat.completions.create(model=checkpoint("qwen3"), messages=CHAT, max_tokens=20, temperature=0)
    text, reasons, usage = _stream_text(client.chat.completions.create(
        model=checkpoint("qwen3"), messages=CHAT, max_tokens=20, temperature=0, stream=True))
    assert text == whole.choices[0].message.content and reasons[-1] == "length" and usage is None


def test_stream_ends_with_done_and_usage_chunk(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers()) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert all(json.loads(e)["usage"] is None for e in events[:-2])


# ------------------------------------------------------------------------------------- errors
def _error(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_bad_requests_are_400_with_openai_shaped_bodies(server, client):
    model = checkpoint("qwen3")
    cases = [
        (dict(prompt="hi " * 600, max_tokens=4), "max_model_len", "prompt"),          # prompt over the context
        (dict(prompt=PROMPTS[0], max_tokens=510), "max_model_len", "prompt"),        # prompt + max_tokens over it
        (dict(prompt=PROMPTS[0], temperature=-1), "temperature", "temperature"),
        (dict(prompt=PROMPTS[0], top_p=0), "top_p", "top_p"),
        (dict(prompt=PROMPTS[0], max_tokens=0), "max_tokens", "max_tokens"),
        (dict(prompt=PROMPTS[0], logprobs=21), "logprobs", "logprobs"),              # too many logprobs
        (dict(prompt=""), "empty", "prompt"),
        (dict(prompt=[10**9]), "vocabulary", "prompt"),
        (dict(prompt=PROMPTS[0], stop=[""]), "stop", "stop"),
        (dict(prompt=PROMPTS[0], suffix="x"), "suffix", "suffix"),
        (dict(prompt=PROMPTS[0], best_of=3), "best_of", "best_of"),
        (dict(prompt=PROMPTS[0], logit_bias={"abc": 1}), "token ids", "logit_bias"),
    ]
    for kwargs, words, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=model, **kwargs)
        err = _error(exc)
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and words in err["message"] and err["param"] == param, (kwargs, err)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=21)
    assert _error(exc)["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=[])
    assert _error(exc)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=CHAT,
                                       tools=[{"type": "function", "function": {"parameters": {}}}])  # no name
    assert _error(exc)["param"] == "tools.0"
    # malformed JSON and a body that is not an object
    for raw in (b'{"prompt": "hi", ', b"[1, 2]"):
        r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={**server.headers(),
                                                                               "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    # the server stays up and keeps serving
    assert client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens == 2
    server.wait_idle()


def test_unsupported_fields_are_refused_only_off_their_default(client, llm):
    model = checkpoint("qwen3")
    want = greedy(llm, PROMPTS[0], 6).text
    defaults = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, presence_penalty=0,
                                         frequency_penalty=0, logit_bias={}, best_of=1, n=1, echo=False,
                                         extra_body={"repetition_penalty": 1.0})
    assert defaults.choices[0].text == want
    chat_defaults = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, logprobs=False,
                                                   tool_choice="none", response_format={"type": "text"})
    assert chat_defaults.usage.completion_tokens == 2
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2),
                         ("logit_bias", {"11": 5}), ("logprobs", 2)):
        if field in EngineSamplingParams.model_fields:  # the engine honours it: served (its values: test_sampling*)
            got = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, extra_body={field: value})
            assert got.usage.completion_tokens == 2
            continue
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, extra_body={field: value})
        err = _error(exc)
        assert err["param"] == field and err["code"] == "unsupported_parameter" and "leave it out" in err["message"]


def test_logit_bias_and_penalties_reach_the_engine(client, llm):
    model = checkpoint("qwen3")
    biased = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                       logit_bias={"11": 100})
    assert biased.choices[0].text == llm.tokenizer.decode([11] * 3)
    want = greedy(llm, PROMPTS[1], 8, repetition_penalty=1.5, presence_penalty=0.5).text
    got = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                    presence_penalty=0.5, extra_body={"repetition_penalty": 1.5})
    assert got.choices[0].text == want


def test_logprobs_are_the_engines_own(client, llm):
    """The chosen token's logprob and the top alternatives, as the engine computes them for `generate`."""
    model = checkpoint("qwen3")
    text = llm.tokenizer.decode
    (want,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)
    got = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3).choices[0]
    assert got.logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert got.logprobs.tokens == [text([e.token_id]) for e in want.logprobs]
    for top, e in zip(got.logprobs.top_logprobs, want.logprobs):
        assert set(top) >= {text([i]) for i, _ in e.top} and len(top) <= 4
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert [lp for part in streamed for lp in part.token_logprobs] == got.logprobs.token_logprobs
    ids = llm.chat_prompt_ids(CHAT)
    (want,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0].logprobs.content
    assert [c.logprob for c in chat] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert [[t.token for t in c.top_logprobs] for c in chat] == [[text([i]) for i, _ in e.top] for e in want.logprobs]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    err = _error(exc)
    assert err["code"] == "model_not_found" and err["param"] == "model" and checkpoint("qwen3") in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=1)


def test_api_key_is_required(server):
    from openai import OpenAI

    for key in ("wrong", API_KEY + "x", ""):
        bad = OpenAI(base_url=f"{server.url}/v1", api_key=key or "none", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as exc:
            bad.completions.create(model=checkpoint("qwen3"), prompt="hi", max_tokens=1)
        assert _error(exc)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open to probes
    r = httpx.get(f"{server.url}/v1/nothing", headers=server.headers())
    assert r.status_code == 404 and "error" in r.json()


# --------------------------------------------------------------------------------- disconnects
def test_disconnect_mid_stream_aborts_and_frees_blocks(server, client):
    before = server.metrics().get('nanoplug_request_finished_total{finish_reason="abort"}', 0)
    stream = client.completions.create(model=checkpoint("qwen3"), prompt=PROMPTS[2], max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    assert server.metrics()["nanoplug_kv_blocks_used"] > 0  # still generating
    stream.close()  # the client goes away
    after = server.wait_idle(timeout=5)
    assert after['nanoplug_request_finished_total{finish_reason="abort"}'] == before + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    before = server.metrics().get('nanoplug_request_finished_total{finish_reason="abort"}', 0)
    body = {"prompt": PROMPTS[2], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers(), timeout=httpx.Timeout(5, read=0.3))
    after = server.wait_idle(timeout=5)
    assert after['nanoplug_request_finished_total{finish_reason="abort"}'] == before + 1


# ---------------------------------------------------------------------------- the bounded queue
def test_full_queue_is_503_with_retry_after(request):
    small = start_server(request, "--max-waiting", "1", engine={**ENGINE, "max_num_seqs": 1})
    client = small.client()
    long = dict(model=checkpoint("qwen3"), prompt=PROMPTS[2], max_tokens=480, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
    first = client.completions.create(**long)
    next(iter(first))  # running
    second = client.completions.create(**long)  # waiting: the queue's one place
    r = httpx.post(f"{small.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=small.headers())
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=checkpoint("qwen3"), prompt="hi", max_tokens=1)
    first.close()
    second.close()
    small.wait_idle()
    assert client.completions.create(model=checkpoint("qwen3"), prompt="hi", max_tokens=1).usage.completion_tokens == 1


# ----------------------------------------------------------------------------------- shutdown
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_ends_open_streams_with_an_error_and_exits(request, sig):
    import psutil

    server = start_server(request)
    (engine,) = psutil.Process(server.pid).children()  # the engine core's own process
    assert_signal_ends_streams(server, sig)
    engine.wait(timeout=20)  # raises if the engine process outlives the server


def assert_signal_ends_streams(doomed, sig: str) -> None:
    """An open stream gets a final error event, and the server exits soon after, without a traceback."""
    import signal

    client = doomed.client()
    stream = client.completions.create(model=checkpoint("qwen3"), prompt=PROMPTS[2], max_tokens=480, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks, errors = [], []

    def read():
        try:
            for chunk in stream:
                chunks.append(chunk)
        except openai.APIError as exc:
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    while not chunks:
        time.sleep(0.01)
    doomed.signal(getattr(signal, sig))
    t = time.monotonic()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert len(errors) == 1 and "shutting down" in str(errors[0]), (errors, chunks[-1:])
    doomed.proc.wait(timeout=20)
    assert time.monotonic() - t < 20
    assert "Traceback" not in doomed.output, doomed.output


# ---------------------------------------------------------------------------------- the command
def test_serve_refuses_bad_options_in_one_line(capsys):
    from nanoplug.cli import main

    for args, words in ((["--port", "70000"], "--port 70000"), (["--max-waiting", "-1"], "--max-waiting"),
                        (["--model", checkpoint("qwen3"), "--max-num-seqs", "0"], "--max-num-seqs")):
        capsys.readouterr()
        assert main(["serve", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nanoplug: error: ") and words in err and err.count("\n") == 1, err
