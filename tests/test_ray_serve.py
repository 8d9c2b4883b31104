"""nanoplug on Ray Serve (nanoplug/server/ray_serve.py) on a local Ray cluster this test starts (2 CPUs).

Two replicas of the tiny Qwen3 answer through Serve's HTTP proxy with the engine's greedy text, requests spread
over both (the `x-nanoplug-replica` header), and when one replica's actor is killed Serve replaces it while the
requests sent meanwhile all succeed on the other.
"""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import time

import httpx
import pytest

from _checkpoints import checkpoint

ENGINE = {"device": "cpu", "max_model_len": "256", "kv_block_size": "16", "num_kv_blocks": "64", "max_num_seqs": "8"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    # replicas and handles report their ongoing requests every half second (the autoscaling test's pace)
    pace = [f"RAY_SERVE_{side}_AUTOSCALING_METRIC_PUSH_INTERVAL_S" for side in ("REPLICA", "HANDLE")]
    saved = {name: os.environ.get(name) for name in pace}
    os.environ.update({name: "0.5" for name in pace})
    # a short temp dir (Ray's socket paths must stay under 107 bytes) and a small object store (no /dev/shm need)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"), namespace="nanoplug-test")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _complete(url: str, prompt: str) -> tuple[str, str]:
    r = httpx.post(f"{url}/v1/completions", json={"model": checkpoint("qwen3"), "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0}, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["text"], r.headers["x-nanoplug-replica"]


def _story() -> str:
    """What Serve and Ray said of the replicas (the controller's replica lines, the raylet's kills, each replica's
    last error lines): a replacement that never comes fails the test with its cause, not a bare state."""
    import glob

    import ray

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    lines = []
    for path in glob.glob(f"{logs}/serve/controller_*.log"):
        lines += [line for line in open(path) if "Replica" in line or "ERROR" in line or "WARNING" in line][-20:]
    lines += [line for line in open(f"{logs}/raylet.out") if "kill" in line.lower() or " E " in line][-10:]
    for path in sorted(glob.glob(f"{logs}/worker-*.err")):
        lines += [f"{path.rsplit('/', 1)[-1]}: {line}" for line in open(path).readlines()[-5:]]
    return "".join(line[:300] + ("\n" if not line.endswith("\n") else "") for line in lines)


def _replicas() -> list[str]:
    from ray import serve

    deployment = serve.status().applications["nanoplug"].deployments["nanoplug"]
    return [deployment.status, deployment.replica_states.get("RUNNING", 0)]


@pytest.mark.slow
def test_two_replicas_spread_and_a_killed_one_is_replaced(cluster):
    import ray
    from ray import serve

    from nanoplug import LLM, SamplingParams
    from nanoplug.server.ray_serve import build

    serve.run(build({"model": checkpoint("qwen3"), "num_replicas": "2", "num_cpus": "0.5", **ENGINE}),
              name="nanoplug", route_prefix="/")
    llm = LLM(checkpoint("qwen3"), **{k: v if k == "device" else int(v) for k, v in ENGINE.items()})
    want = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].text
    llm.close()

    seen: list[tuple[str, str]] = []
    threads = [threading.Thread(target=lambda: seen.append(_complete(cluster, "Hello there"))) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {text for text, _ in seen} == {want}
    before = {replica for _, replica in seen}
    assert len(before) == 2, "the requests should spread over both replicas"

    (victim,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(sorted(before)[0])]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    after = [_complete(cluster, "Hello there") for _ in range(6)]  # nothing lost while it is replaced
    assert {text for text, _ in after} == {want}
    # a replacement imports torch and builds an engine in a fresh worker: seconds here, over 40 s on a busy CI host
    deadline = time.monotonic() + 120
    while _replicas() != ["HEALTHY", 2] and time.monotonic() < deadline:
        time.sleep(0.5)
    deployment = serve.status().applications["nanoplug"].deployments["nanoplug"]
    assert _replicas() == ["HEALTHY", 2], f"{deployment.replica_states} {deployment.message}\n{_story()}"
    again: set[str] = set()
    while not again - before and time.monotonic() < deadline + 30:  # once the proxy's router hears of it
        text, replica = _complete(cluster, "Hello there")
        assert text == want
        again.add(replica)
    assert again - before, "a new replica should serve in place of the killed one"


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_a_queue_and_removes_it_after(cluster):
    """min 1, max 2, one ongoing request a replica as the target: a steady queue of 4 brings the second replica
    (which then answers too), and once the queue is gone Serve goes back to one; every request succeeds."""
    from ray import serve

    from nanoplug.server.ray_serve import build

    serve.delete("nanoplug")
    serve.run(build({"model": checkpoint("qwen3"), "min_replicas": "1", "max_replicas": "2",
                     "target_ongoing_requests": "1", "upscale_delay_s": "0", "downscale_delay_s": "2",
                     "look_back_period_s": "11", "num_cpus": "0.5", **ENGINE}),
              name="nanoplug", route_prefix="/")
    assert _replicas() == ["HEALTHY", 1]
    stop, answered, errors = threading.Event(), set(), []

    def client():
        while not stop.is_set():
            try:
                r = httpx.post(f"{cluster}/v1/completions", json={"model": checkpoint("qwen3"), "prompt": "Hi",
                                                                  "max_tokens": 48, "temperature": 0}, timeout=60)
                r.raise_for_status()
                answered.add(r.headers["x-nanoplug-replica"])
            except Exception as exc:  # noqa: BLE001 (counted: none may fail)
                errors.append(repr(exc))

    clients = [threading.Thread(target=client) for _ in range(4)]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 60
    while (_replicas()[1] < 2 or len(answered) < 2) and time.monotonic() < deadline:
        time.sleep(0.5)
    scaled_up, served_by = _replicas(), set(answered)
    stop.set()
    for t in clients:
        t.join()
    assert scaled_up[1] == 2 and len(served_by) == 2, (scaled_up, served_by)
    deadline = time.monotonic() + 60
    while _replicas()[1] != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _replicas()[1] == 1
    assert not errors
