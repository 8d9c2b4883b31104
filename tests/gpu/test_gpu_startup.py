"""The start-up guarantees on CUDA in bfloat16, for `flash` and `triton` decode under CUDA graphs with
fused small-op kernels: `LLM(...)` logs one line splitting its start-up into phases, and after it returns
nothing is compiled (torch.compile graphs, Triton JIT kernels) or captured again over 100 mixed requests,
greedy and sampled, batched and streamed from threads; every decode step replays a graph
(`cuda={"require_graphs": True}`: a capture that fails stops start-up, saying why). The CPU version is
tests/test_graph_guard.py.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_startup.py`."""
from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from _graph_guard import Compilations, StepLog, check_startup_line, mixed_workload
from nanoplug.bench.checkpoints import write_random_checkpoint

pytestmark = pytest.mark.gpu
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128)
# a fixed cache (no memory profiling against other engines of this process): 40 sequences of up to 184 tokens
ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=1024, kv_block_size=256, num_kv_blocks=128,
              cuda={"require_graphs": True})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    return str(write_random_checkpoint(tmp_path_factory.mktemp("gpu-startup") / "q3", **GPU_SHAPE))


def start(model, attention):
    from nanoplug import LLM
    from nanoplug.errors import NanoplugError

    try:
        return LLM(model, attention=attention, **ENGINE)
    except NanoplugError as exc:
        if attention == "flash" and "pip install flash-attn" in str(exc):
            pytest.skip("no FlashAttention build here")
        raise


@pytest.mark.parametrize("attention", ["flash", "triton"])
def test_start_up_is_logged_and_nothing_compiles_or_captures_after_it(model, attention, caplog):
    with Compilations() as compiled:
        with caplog.at_level(logging.INFO, logger="nanoplug"):
            llm = start(model, attention)
        try:
            worker = llm.engine.worker
            before = worker.report()
            check_startup_line(caplog.text, before)
            assert before.startup.warm_up_s > 0 and before.startup.graphs_s > 0
            assert before.graphs_error is None and before.graph_captures > 0
            assert worker.graph_limit == 256  # (cuda/graphs.py GRAPH_BATCH_SIZES up to max_num_seqs)
            norms = [m for m in worker.model.modules() if type(m).__name__ == "RMSNorm"]
            assert norms and all(m.fused.__module__.endswith("cuda.fused_ops") for m in norms), \
                "the small ops should run as the platform's Triton kernels (which the guard watches)"
            assert compiled.watching_triton == (importlib.util.find_spec("triton") is not None)
            dynamo, triton = compiled.dynamo_graphs(), list(compiled.triton)
            steps = StepLog(worker)
            assert mixed_workload(llm, max_prompt=160) == 100
            after = worker.report()
        finally:
            llm.close()
    assert after.graph_captures == before.graph_captures
    assert compiled.dynamo_graphs() == dynamo, "torch.compile compiled inside a request's steps"
    assert compiled.triton == triton, f"Triton kernels compiled inside a request's steps: {compiled.triton[len(triton):]}"
    decodes = steps.decode_batches()
    stats = after.stats
    assert max(decodes) <= 256
    assert stats.eager_decode_steps == 0 and stats.eager_decode_steps_by_design == 0, stats
    assert stats.graph_replays == len(decodes) > 0, stats
