"""Recorded decode steps under the `tensor` plugin on CPU (gloo): tp=2 replays them and gives tp=1's tokens
and logits; a capture that fails on one rank only leaves every rank eager (one replaying while another
runs eager would deadlock their collectives), with the failing rank named, or stops every rank under
require_graphs."""
from __future__ import annotations

import pytest

import tensor_parallel_helpers as helpers
from _test_platforms import registry_with_platform
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.plugins.parallel.tensor.pool import WorkerError

pytestmark = pytest.mark.slow  # each tp=2 engine starts two processes
PROMPTS = ["hello there", "one two three four"]
OPTIONS = dict(device="cpu", dtype="float32", attention="cpu", kv_cache="torch", kv_block_size=16, num_kv_blocks=32,
               max_model_len=128, max_num_seqs=2)  # recordings of 1 and 2 rows
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_logits=True)
FAILING = "cpu_capture_fails_on_rank1"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # the `cpu` attention backend (recordable) takes head sizes from 64
    return str(write_random_checkpoint(tmp_path_factory.mktemp("tp_graphs") / "qwen3", tie_word_embeddings=True,
                                       hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64))


@pytest.fixture(scope="module")
def tp1(ckpt):
    llm = LLM(ckpt, parallel="single", **OPTIONS)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    report = llm.engine.worker.report()
    llm.close()
    assert report.graphs_error is None and report.stats.graph_replays > 0
    return outs


def _assert_same(reference, outs):
    for ref, out in zip(reference, outs):
        assert out.token_ids == ref.token_ids
        for a, b in zip(ref.logits, out.logits):
            assert float((a - b).abs().max() / a.abs().max()) <= 1e-5


def test_tp2_replays_recorded_decode_and_gives_tp1s_outputs(ckpt, tp1):
    with LLM(ckpt, parallel="tensor", tensor_parallel_size=2, **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        report = llm.engine.worker.report()
    assert report.graphs_error is None and report.graph_captures == 2
    assert report.stats.graph_replays > 0 and report.stats.eager_decode_steps == 0
    _assert_same(tp1, outs)


def test_a_capture_failing_on_rank_1_leaves_both_ranks_eager(ckpt, tp1):
    registry = registry_with_platform(FAILING, helpers.CaptureFailsOnRank1)
    with LLM(ckpt, registry=registry, platform=FAILING, parallel="tensor", tensor_parallel_size=2, **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        report = llm.engine.worker.report()  # rank 0's: its own capture succeeded
    assert "failed on rank 1 of 2" in report.graphs_error
    assert "rank 1: injected capture failure on rank 1" in report.graphs_error
    assert report.graph_captures == 0  # rank 0 dropped the graphs it had captured
    assert report.stats.graph_replays == 0 and report.stats.eager_decode_steps > 0
    _assert_same(tp1, outs)


def test_require_graphs_stops_every_rank_naming_the_failing_one(ckpt):
    registry = registry_with_platform(FAILING, helpers.CaptureFailsOnRank1)
    with pytest.raises(WorkerError) as info:
        LLM(ckpt, registry=registry, platform=FAILING, **{FAILING: {"require_graphs": True}},
            parallel="tensor", tensor_parallel_size=2, **OPTIONS)
    message = str(info.value)
    assert "failed on rank 1 of 2" in message and "require_graphs stops start-up" in message
    assert "--- rank 0 ---" in message  # rank 0 stopped on the agreed failure too, not in a hung collective
