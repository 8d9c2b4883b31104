"""Small fresh prefills replay CUDA graphs (cuda/prefill_graphs.py) and give the eager engine's first tokens.

`flash` claims `supports_prefill_graphs`: prefills of 1 to 8 sequences and up to 2048 tokens, with no cached
context, replay a captured graph padded up to its token bucket; longer ones, prefix-cache hits and more
sequences run eager. The first token's logits equal the eager engine's (`cuda.enforce_eager`) to the bf16
tolerance, and nothing is captured after start-up.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_prefill_graphs.py`."""
from __future__ import annotations

import random

import pytest
import torch

from _checkpoints import relative_error
from nanoplug.bench.checkpoints import write_random_checkpoint

pytestmark = pytest.mark.gpu
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)
ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=4096, kv_block_size=256, num_kv_blocks=256,
              attention="flash", enable_prefix_caching=False)
# (prompt lengths of one generate, whether its prefill fits a captured one)
BATCHES = [([5], True), ([512], True), ([700, 33, 1000], True), ([2048], True), ([3000], False),
           ([40] * 8, True), ([40] * 9, False)]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    from nanoplug import LLM, SamplingParams

    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    path = str(write_random_checkpoint(tmp_path_factory.mktemp("gpu-prefill-graphs") / "q3", **GPU_SHAPE))
    rng = random.Random(0)
    batches = [[[rng.randrange(1000) for _ in range(n)] for n in lengths] for lengths, _ in BATCHES]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, output_logits=True)
    out = {}
    for eager in (True, False):
        llm = LLM(path, cuda={"enforce_eager": True} if eager else {"require_graphs": True}, **ENGINE)
        try:
            worker = llm.engine.worker
            captures = worker.report().graph_captures
            assert eager or worker.graphs.prefill is not None
            out[eager] = []
            for prompts in batches:
                before = worker.report().stats.prefill_graph_replays
                result = llm.generate(prompts, params, use_tqdm=False)
                out[eager].append((result, worker.report().stats.prefill_graph_replays - before))
            assert worker.report().graph_captures == captures  # nothing captured after start-up
        finally:
            llm.close()
    return out


@pytest.mark.parametrize("index", range(len(BATCHES)))
def test_small_fresh_prefills_replay_a_graph_and_equal_eager(outputs, index):
    lengths, fits = BATCHES[index]
    (eager, eager_replays), (graphed, replays) = outputs[True][index], outputs[False][index]
    assert eager_replays == 0 and replays == (1 if fits else 0), (lengths, replays)
    for a, b in zip(eager, graphed, strict=True):
        assert relative_error(b.logits[0].float(), a.logits[0].float()) < 2.5e-2, lengths
