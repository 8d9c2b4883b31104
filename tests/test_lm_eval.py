"""lm-eval, the usual benchmark harness, against `nanoplug serve` on the embedded default model (issue 32
item 6): its `local-completions` model runs a tiny task of our own with a `generate_until` part (text
generation with a stop string) and a `multiple_choice` part (loglikelihood: echo, logprobs and the
prompt's token logprobs), two requests at a time. Each loglikelihood lm-eval reports must be the
engine's own prompt logprobs for the same tokens, and each generation the server's greedy answer.

lm-eval's import is heavy (datasets, evaluate): the test takes ~1-2 minutes on 2 busy CPU cores."""
from __future__ import annotations

import json
import math
import textwrap

import httpx
import pytest

from _server import ServerProcess

lm_eval = pytest.importorskip("lm_eval", reason="pip install 'nanoplug[test]' (lm-eval)")

GEN = [{"question": "Question: What is the capital of France?\nAnswer:", "answer": " Paris"},
       {"question": "1, 2, 3, 4,", "answer": " 5"}]
MC = [{"question": "The capital of France is", "choices": [" Paris", " a purple elephant"], "label": 0},
      {"question": "One, two, three,", "choices": [" banana spaceship", " four"], "label": 1}]


def _tasks(folder) -> None:
    for name, rows in (("gen", GEN), ("mc", MC)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ntest_split: test\ndoc_to_text: \"{{{{question}}}}\"\n"
    (folder / "gen.yaml").write_text(textwrap.dedent(f"""\
        task: nanoplug_tiny_gen
        dataset_kwargs: {{data_files: {{test: {folder / 'gen.jsonl'}}}}}
        output_type: generate_until
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs: {{until: ["\\n"], max_gen_toks: 6, do_sample: false}}
        metric_list: [{{metric: exact_match}}]
        """) + common)
    (folder / "mc.yaml").write_text(textwrap.dedent(f"""\
        task: nanoplug_tiny_mc
        dataset_kwargs: {{data_files: {{test: {folder / 'mc.jsonl'}}}}}
        output_type: multiple_choice
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{label}}}}"
        metric_list: [{{metric: acc}}]
        """) + common)


@pytest.mark.slow
def test_lm_eval_local_completions_generates_and_scores_against_the_server(tmp_path, request):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from nanoplug.checkpoint.default_model import default_model_path

    model = str(default_model_path(progress=False))
    server = ServerProcess(model=model, api_key=None, engine=dict(max_model_len=512, max_num_seqs=8))
    request.addfinalizer(server.proc.kill)
    server.wait_ready()
    _tasks(tmp_path)
    out = simple_evaluate(
        model="local-completions",
        model_args=f"model={model},base_url={server.url}/v1/completions,tokenizer={model},num_concurrent=2,"
                   "max_retries=1,max_length=512",
        tasks=["nanoplug_tiny_gen", "nanoplug_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, limit=None)

    tokenizer = AutoTokenizer.from_pretrained(model)
    assert len(out["samples"]["nanoplug_tiny_mc"]) == len(MC) and len(out["samples"]["nanoplug_tiny_gen"]) == len(GEN)
    scored = 0
    for sample in out["samples"]["nanoplug_tiny_mc"]:  # each choice's loglikelihood: the engine's prompt logprobs
        for (context, continuation), ((ll, _),) in zip((a for a in sample["arguments"]), sample["resps"]):
            ctx, cont = tokenizer.encode(context), tokenizer.encode(continuation)
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "prompt": ctx + cont, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0})
            want = sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(ctx):])
            assert math.isfinite(ll) and ll < 0 and ll == pytest.approx(want, abs=1e-4)
            scored += 1
    assert scored == sum(len(d["choices"]) for d in MC)
    assert out["results"]["nanoplug_tiny_mc"]["acc,none"] >= 0.5
    for sample in out["samples"]["nanoplug_tiny_gen"]:  # each generation: the server's greedy text
        ((answer,),) = sample["resps"]
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": sample["arguments"][0][0], "max_tokens": 6, "temperature": 0, "stop": ["\n"], "seed": 1234})
        assert answer == r.json()["choices"][0]["text"]
    assert "Session is closed" not in server.output
