"""LoRA adapters over HTTP and the gateway's metrics, on a real `nanoplug serve` through the official openai client.

Adapters are real PEFT folders written by peft on the tiny random Qwen3; each answer must equal the Python API's
(`LLM(..., adapters=[{..., "merge": False}])` with `SamplingParams(adapter=name)`) for the same adapter, with the
base model and both adapters in the same batches. At run time an adapter is loaded and unloaded through vLLM's
routes while another request streams, a bad folder is a 400 naming the problem that costs no other request, and
the routes are refused without --allow-runtime-lora. /metrics is scraped while requests run and after.
"""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from _checkpoints import PROMPTS, checkpoint
from _peft_loras import peft_lora
from _server import start_server
from nanoplug import LLM, SamplingParams
from nanoplug.config import EngineConfig
from nanoplug.server.app import ServerSettings, build_app

STEPS = 8
ENGINE = dict(kv_block_size=16, num_kv_blocks=128, max_model_len=512, max_num_seqs=8)  # few batch sizes to record


@pytest.fixture(scope="module")
def loras():
    return {"one": peft_lora("qwen3", seed=1), "two": peft_lora("qwen3", seed=6, r=4, alpha=8)}


@pytest.fixture(scope="module")
def server(request, loras):
    return start_server(request, "--lora", f"one={loras['one']}", "--allow-runtime-lora", "--max-loras", "2",
                        engine=ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def want(loras):
    """The Python API's greedy tokens of every prompt under each adapter and none."""
    llm = LLM(checkpoint("qwen3"), **ENGINE, adapters=[{"path": p, "name": n, "merge": False} for n, p in loras.items()])
    try:
        return {name: [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS,
                                                                            adapter=name), use_tqdm=False)]
                for name in (None, "one", "two")}
    finally:
        llm.close()


def answers(client, model: str) -> list[str]:
    return [client.completions.create(model=model, prompt=p, max_tokens=STEPS, temperature=0).choices[0].text
            for p in PROMPTS]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers(), timeout=60)


@pytest.mark.slow  # a server process with adapters
def test_models_lists_each_adapter_with_its_parent(server, client, loras):
    models = {m.id: m for m in client.models.list().data}
    base = checkpoint("qwen3")
    assert list(models) == [base, "one"]
    assert models["one"].parent == base and models["one"].root == loras["one"] and models[base].parent is None


@pytest.mark.slow  # a server process with adapters
def test_requests_pick_adapters_by_model_and_share_steps(client, want):
    base = checkpoint("qwen3")
    got: dict = {}
    threads = [threading.Thread(target=lambda m=m: got.__setitem__(m, answers(client, m))) for m in (base, "one")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[base] == want[None] and got["one"] == want["one"]
    assert want["one"] != want[None]
    chat = client.chat.completions.create(model="one", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "one"


@pytest.mark.slow  # a server process with adapters
def test_an_unknown_model_is_a_404_listing_the_served_names(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    message = str(err.value)
    assert "'nope'" in message and "'one'" in message and checkpoint("qwen3") in message


@pytest.mark.slow  # a server process with adapters
def test_load_and_unload_at_run_time_cost_no_other_request(server, client, loras, want, tmp_path):
    done: dict = {}
    stream = threading.Thread(target=lambda: done.setdefault("text", "".join(  # runs across every change below
        c.choices[0].text for c in client.completions.create(model="one", prompt=PROMPTS[2], max_tokens=120,
                                                            temperature=0, stream=True))))
    stream.start()
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                              "target_modules": ["q_proj"]}))
    bad = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_model.safetensors" in bad.json()["error"]["message"], bad.text
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and "nowhere" in missing.json()["error"]["message"]
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "one", "lora_path": loras["two"]}).status_code == 400
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": loras["two"]})
    assert loaded.status_code == 200 and "two" in loaded.text
    assert [m.id for m in client.models.list().data][1:] == ["one", "two"]
    assert answers(client, "two") == want["two"]
    full = post(server, "/v1/load_lora_adapter", {"lora_name": "three", "lora_path": loras["two"]})
    assert full.status_code == 400 and "slots" in full.json()["error"]["message"]  # --max-loras 2
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "two"}).status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "two"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="two", prompt="hi", max_tokens=1)
    stream.join(timeout=60)
    assert done["text"].startswith(want["one"][2])  # the stream lost nothing to the loads beside it
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": loras["two"]}).status_code == 200
    assert answers(client, "two") == want["two"]  # the reused slot, its prefix cache not the old adapter's


def test_runtime_routes_are_refused_without_the_flag():
    from nanoplug.server.engine_loop import EngineLoop

    engine = EngineLoop(EngineConfig(model=checkpoint("qwen3"), **ENGINE))
    with TestClient(build_app(engine, ServerSettings(model_name="m"))) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 403


# ---------------------------------------------------------------------------------- the gateway's metrics
@pytest.mark.slow  # a server process with adapters
def test_gateway_metrics_move_as_requests_run(server, client):
    label = f'{{model_name="{checkpoint("qwen3")}"}}'
    before = server.wait_idle()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert before[name + label] == 0, name
    stream = client.completions.create(model="one", prompt=PROMPTS[2], max_tokens=200, temperature=0, stream=True)
    next(iter(stream))  # it runs now
    during = server.metrics()
    assert during["vllm:num_requests_running" + label] >= 1 and during["vllm:kv_cache_usage_perc" + label] > 0
    info = [k for k in during if k.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'running_lora_adapters="one"' in info[0] and 'max_lora="2"' in info[0], info
    stream.close()
    for _ in range(2):  # the second request's prompt is in the prefix cache
        client.completions.create(model=checkpoint("qwen3"), prompt=PROMPTS[2] * 3, max_tokens=2)
    after = server.wait_idle()
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:time_to_first_token_seconds_count", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert after[name + label] > before.get(name + label, 0), name
    assert 0 < after["nanoplug_prefix_cache_hit_rate" + label] < 1
    assert after["vllm:kv_cache_usage_perc" + label] == 0
