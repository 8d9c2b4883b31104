"""Decode steps recorded once per batch size and replayed on the CPU (nanoplug/plugins/platforms/cpu/graphs.py),
against the same engine stepping eagerly (`cpu={"graphs": False}`) on the same inputs: equal tokens and
logits, greedy and sampled, for batches that fill a recorded size and batches padded up to one. A model
that computes something the recording cannot see, or that reads a value back into Python, is caught at
start-up and runs eagerly with a warning. And the `fp16` KV cache the cpu decode kernel reads directly."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _checkpoints import CHECKPOINTS, PROMPTS, checkpoint
from nanoplug import LLM, SamplingParams
from nanoplug.api import ModelFacts, Target
from nanoplug.api.layers.embedding import VocabParallelEmbedding
from nanoplug.plugins.attention.cpu import CpuAttention
from nanoplug.plugins.kv_cache.fp16 import Fp16Store
from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.plugins.platforms.cpu.graphs import GRAPH_BATCH_SIZES, CpuDecodeGraphs

CHECKPOINTS.setdefault("head64", ("Qwen3ForCausalLM", dict(head_dim=64, num_attention_heads=6,
                                                           num_key_value_heads=2, seed=5)))
ENGINE = dict(kv_block_size=16, kv_cache="torch", num_kv_blocks=96, max_model_len=256, attention="cpu",
              cpu={"kernels": True})
AHEAD = dict(ENGINE, cpu={"kernels": True, "record_ahead": True})  # every size recorded (and checked) at start-up


@pytest.fixture(scope="module")
def path():
    assert cpu_kernels.unavailable() is None, "these tests need the CPU kernels (a C++ compiler)"
    return checkpoint("head64")


@pytest.fixture(scope="module")
def engines(path):
    eager = LLM(path, **{**ENGINE, "cpu": {"kernels": True, "graphs": False}})
    graphs = LLM(path, **ENGINE)
    yield eager, graphs
    eager.close()
    graphs.close()


def count_replays(monkeypatch) -> list[int]:
    sizes: list[int] = []
    replay = CpuDecodeGraphs.replay

    def counted(self, size, inputs, previous):
        sizes.append(size)
        return replay(self, size, inputs, previous)

    monkeypatch.setattr(CpuDecodeGraphs, "replay", counted)
    return sizes


def test_each_batch_size_is_planned_and_recorded_when_first_needed(engines):
    eager, graphs = engines
    assert eager.engine.worker.graphs is None
    recorded = graphs.engine.worker.graphs
    assert recorded.sizes == GRAPH_BATCH_SIZES and set(recorded.graphs) <= set(GRAPH_BATCH_SIZES)


@pytest.mark.parametrize("num_prompts", [1, 3, 13])  # a recorded size, padded to 4, padded to 16
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replayed_steps_give_the_eager_tokens_and_logits(engines, monkeypatch, num_prompts, temperature):
    eager, graphs = engines
    replays = count_replays(monkeypatch)
    prompts = (PROMPTS * 4)[:num_prompts]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, ignore_eos=True, output_logits=True)
    for a, b in zip(eager.generate(prompts, params, use_tqdm=False), graphs.generate(prompts, params, use_tqdm=False),
                    strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert torch.equal(la, lb)  # the same kernels on the same inputs
    assert replays and min(replays) >= num_prompts and set(replays) <= set(GRAPH_BATCH_SIZES)


def test_the_default_gguf_model_replays_its_decode_steps(monkeypatch):
    from nanoplug.checkpoint.default_model import default_model_path

    folder = str(default_model_path())
    options = dict(device="cpu", kv_block_size=16, max_model_len=512, cpu={"kv_cache_gb": 0.1},
                   enable_prefix_caching=False)
    eager = LLM(folder, **{**options, "cpu": {"kv_cache_gb": 0.1, "graphs": False}})
    graphs = LLM(folder, **options)
    replays = count_replays(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, output_logits=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    for a, b in zip(eager.generate(prompts, params, use_tqdm=False), graphs.generate(prompts, params, use_tqdm=False)):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(la, lb) for la, lb in zip(a.logits, b.logits, strict=True))
    assert replays
    eager.close()
    graphs.close()


def outputs(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_computation_the_recording_cannot_see_is_caught_at_start_up(path, engines, monkeypatch, caplog):
    def numpy_embedding(self, ids):  # a gather outside torch's ops: a replay would repeat the recorded rows
        return torch.from_numpy(self.weight.detach().numpy()[ids.numpy()])

    monkeypatch.setattr(VocabParallelEmbedding, "forward", numpy_embedding)
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        llm = LLM(path, **AHEAD)
    assert llm.engine.worker.graphs is None
    assert "decode steps run eager" in caplog.text and "differs from the eager one" in caplog.text
    assert outputs(llm) == outputs(engines[0])
    llm.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanoplug"), LLM(path, **ENGINE) as lazy:  # caught at first use
        assert outputs(lazy) == outputs(engines[0])
        assert lazy.engine.worker.graphs.failed and not lazy.engine.worker.graphs.graphs
    assert "rows run eager" in caplog.text and "differs from the eager one" in caplog.text


def test_a_cache_write_the_recording_cannot_see_is_caught_at_start_up(path, engines, monkeypatch, caplog):
    from nanoplug.plugins.kv_cache.torch import TorchStore

    def numpy_store(self, k, v, k_cache, v_cache, slot_mapping, layer):  # as Triton's CPU interpreter writes
        slots = slot_mapping.numpy()
        k_cache.view(-1, *k_cache.shape[2:]).numpy()[slots] = k.numpy()
        v_cache.view(-1, *v_cache.shape[2:]).numpy()[slots] = v.numpy()

    monkeypatch.setattr(TorchStore, "store", numpy_store)
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        llm = LLM(path, **AHEAD)
    assert llm.engine.worker.graphs is None
    assert "differs from the eager one" in caplog.text
    assert outputs(llm) == outputs(engines[0])
    llm.close()


def test_a_value_read_back_into_python_is_caught_at_start_up(path, engines, monkeypatch, caplog):
    forward = VocabParallelEmbedding.forward

    def checked(self, ids):
        if ids.max().item() >= self.weight.shape[0]:  # a host read of the data: nothing a replay can repeat
            raise IndexError(ids.max().item())
        return forward(self, ids)

    monkeypatch.setattr(VocabParallelEmbedding, "forward", checked)
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        llm = LLM(path, **AHEAD)
    assert llm.engine.worker.graphs is None
    assert "depends on the data" in caplog.text
    assert outputs(llm) == outputs(engines[0])
    llm.close()


# ------------------------------------------------------------------------------------ the fp16 KV cache
def test_an_fp16_cache_holds_twice_the_tokens_and_stays_close(path, engines):
    small = dict(ENGINE, num_kv_blocks=None, cpu={"kernels": True, "kv_cache_gb": 0.002})
    full, half = LLM(path, **small), LLM(path, **{**small, "kv_cache": "fp16"})
    assert abs(half.engine.worker.num_blocks - 2 * full.engine.worker.num_blocks) <= 1  # whole blocks of a budget
    assert half.engine.worker.kv_cache.dtype == torch.float16
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_logits=True)
    ref = engines[0].generate(PROMPTS, params, use_tqdm=False)
    got = half.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ref, got):
        # float16 K/V round at 2^-11 relative: the logits move by ~1e-4, far less than between tokens
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(la, lb, rtol=0, atol=2e-3)
    full.close()
    half.close()


def test_the_fp16_cache_says_where_it_does_not_serve():
    facts = ModelFacts(architecture="Qwen3ForCausalLM", num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                       hidden_size=576, vocab_size=1000)
    bf16 = Target(device=torch.device("cpu"), dtype=torch.bfloat16, model=facts)
    assert any("already 2 bytes" in r for r in Fp16Store.unavailable(bf16))
    fp16_cache = Target(device=torch.device("cpu"), dtype=torch.float32, model=facts, kv_cache_dtype=torch.float16)
    assert CpuAttention.unavailable(fp16_cache) == []
    bf16_cache = Target(device=torch.device("cpu"), dtype=torch.float32, model=facts, kv_cache_dtype=torch.bfloat16)
    assert any("float32 or float16 cache" in r for r in CpuAttention.unavailable(bf16_cache))


def test_recording_imports_no_dynamo():
    """torch wraps a dispatch mode's __torch_dispatch__ against Dynamo, and the wrapper imports torch._dynamo at its
    first call: half a second of a CLI's second token. The recorder opts out (it never runs under Dynamo)."""
    code = ("import sys, torch; from nanoplug.plugins.platforms.cpu.graphs import record; "
            "x = torch.arange(6.0); plan, keep, out = record(lambda i, p: (i.reshape(-1) * 2).sum(0, keepdim=True), x, x); "
            "plan and [call() for call in plan]; print(len(plan) > 0, 'torch._dynamo' in sys.modules)")
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr
