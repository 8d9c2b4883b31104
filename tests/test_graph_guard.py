"""The start-up guarantees on the CPU (recorded decode steps, `cpu.graphs`): `LLM(...)` logs one line splitting
its start-up into phases; with `cpu.record_ahead`, after it returns nothing is recorded or compiled again, and
every decode step that a recorded size serves replays one; by default a size is recorded when a step first
needs it, and the tokens are the eager engine's (the worker's `StepStats`, checked against the steps it launched). A recording
that fails is recorded (`graphs_error`), its eager decode steps counted as such, and `cpu.require_graphs` makes
it an error that names the cause and the fix. The CUDA version is tests/gpu/test_gpu_startup.py."""
from __future__ import annotations

import logging

import pytest

from _checkpoints import CHECKPOINTS, checkpoint
from _graph_guard import Compilations, StepLog, check_startup_line, mixed_workload
from nanoplug import LLM, SamplingParams
from nanoplug.api import GraphCaptureError
from nanoplug.api.layers.embedding import VocabParallelEmbedding
from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.plugins.platforms.cpu.graphs import GRAPH_BATCH_SIZES

CHECKPOINTS.setdefault("head64", ("Qwen3ForCausalLM", dict(head_dim=64, num_attention_heads=6,
                                                           num_key_value_heads=2, seed=5)))
# room for 40 sequences at once (more than the largest recorded size, 32) of up to 100 + 24 tokens
ENGINE = dict(device="cpu", kv_block_size=16, kv_cache="torch", num_kv_blocks=400, max_model_len=256,
              max_num_seqs=48, attention="cpu", cpu={"kernels": True, "graphs": True, "record_ahead": True})
LARGEST = GRAPH_BATCH_SIZES[-1]


@pytest.fixture(scope="module")
def path():
    assert cpu_kernels.unavailable() is None, "these tests need the CPU kernels (a C++ compiler)"
    return checkpoint("head64")


def numpy_embedding(self, ids):  # a gather outside torch's ops: the recording's check catches it
    import torch

    return torch.from_numpy(self.weight.detach().numpy()[ids.numpy()])


def test_start_up_is_logged_once_with_each_phase(path, caplog):
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        llm = LLM(path, **ENGINE)
    try:
        report = llm.engine.worker.report()
        check_startup_line(caplog.text, report)
        assert report.startup == llm.engine.worker.startup
        assert report.startup.graphs_s > 0 and report.startup.load_s > 0
    finally:
        llm.close()


def test_nothing_is_recorded_or_compiled_after_start_up_and_every_decode_step_replays(path):
    with Compilations() as compiled:
        llm = LLM(path, **ENGINE)
        try:
            worker = llm.engine.worker
            before = worker.report()
            assert before.graphs_error is None and before.graph_captures == len(GRAPH_BATCH_SIZES)
            assert worker.graph_limit == LARGEST
            assert before.stats.decode_steps == 0  # start-up's own steps are not counted
            dynamo, triton = compiled.dynamo_graphs(), list(compiled.triton)
            steps = StepLog(worker)
            assert mixed_workload(llm) == 100
            after = worker.report()
        finally:
            llm.close()
    assert after.graph_captures == before.graph_captures and worker.graphs is None  # (dropped by close)
    assert compiled.dynamo_graphs() == dynamo
    assert compiled.triton == triton
    decodes = steps.decode_batches()
    stats = after.stats
    assert stats.eager_decode_steps == 0, stats
    assert stats.graph_replays == sum(n <= LARGEST for n in decodes) > 0, stats
    assert stats.eager_decode_steps_by_design == sum(n > LARGEST for n in decodes) > 0, stats  # the 40 at once
    assert stats.decode_steps == len(decodes)


def test_by_default_a_size_is_recorded_when_first_needed_with_the_eager_engines_tokens(path):
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with LLM(path, **{**ENGINE, "cpu": {"kernels": True, "graphs": False}}) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
        want_one = eager.generate(prompts[:1], params, use_tqdm=False)[0].token_ids
    with LLM(path, **{**ENGINE, "cpu": {"kernels": True}}) as llm:
        worker = llm.engine.worker
        assert worker.report().graph_captures == 0 and worker.graph_limit == LARGEST  # nothing recorded yet
        assert llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids == want_one
        assert worker.report().graph_captures == 1 and list(worker.graphs.graphs) == [1]
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        report = worker.report()
    assert report.graph_captures == 2  # size 1, then 4 (three sequences decode together)
    assert report.stats.eager_decode_steps == 0 and report.stats.graph_replays == report.stats.decode_steps


def test_decode_steps_with_graphs_off_are_eager_by_design(path):
    llm = LLM(path, **{**ENGINE, "cpu": {"kernels": True, "graphs": False}})
    try:
        llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        report = llm.engine.worker.report()
    finally:
        llm.close()
    assert report.graphs_error is None and report.graph_captures == 0
    assert (report.stats.graph_replays, report.stats.eager_decode_steps, report.stats.eager_decode_steps_by_design) \
        == (0, 0, 3)


def test_a_failed_recording_is_recorded_and_its_eager_steps_counted(path, monkeypatch, caplog):
    monkeypatch.setattr(VocabParallelEmbedding, "forward", numpy_embedding)
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        llm = LLM(path, **ENGINE)
    try:
        assert "decode steps run eager (cpu.require_graphs makes this an error)" in caplog.text
        llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        report = llm.engine.worker.report()
    finally:
        llm.close()
    assert "differs from the eager one" in report.graphs_error and "cpu={'graphs': False}" in report.graphs_error
    assert (report.stats.graph_replays, report.stats.eager_decode_steps, report.stats.eager_decode_steps_by_design) \
        == (0, 3, 0)


def test_require_graphs_stops_start_up_naming_the_cause_and_the_fix(path, monkeypatch):
    monkeypatch.setattr(VocabParallelEmbedding, "forward", numpy_embedding)
    with pytest.raises(GraphCaptureError) as caught:
        LLM(path, **{**ENGINE, "cpu": {"kernels": True, "require_graphs": True}})
    message = str(caught.value)
    assert "differs from the eager one" in message  # the cause
    assert "cpu={'graphs': False}" in message and "cpu.require_graphs" in message  # the ways out


def test_require_graphs_with_a_decode_backend_that_cannot_be_captured(path):
    with pytest.raises(GraphCaptureError, match="supports_cuda_graphs is False"):
        LLM(path, **{**ENGINE, "attention": "manual", "cpu": {"kernels": True, "require_graphs": True}})


@pytest.mark.parametrize("cpu", [{"graphs": False, "require_graphs": True}, {"kernels": False, "require_graphs": True}])
def test_require_graphs_with_graphs_turned_off_is_refused_before_start_up(path, cpu):
    with pytest.raises(ValueError, match="drop one of the two"):
        LLM(path, **{**ENGINE, "cpu": cpu})
