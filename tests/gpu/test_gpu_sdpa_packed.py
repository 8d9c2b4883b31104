"""Attention `sdpa` on CUDA where torch's `varlen_attn` reads no page tables (torch 2.11; here forced by pages
of 16 tokens on any torch): paged steps pack each sequence's live pages (nanoplug/kernels/attention/packed_pages.py)
and attend through `varlen_attn`. With a packed buffer too small for a whole batch, decode steps and
prefill chunks over cached context run as several groups; under CUDA graphs, their logits equal those of
an eager engine whose buffer holds the whole batch in one group, to the bf16 tolerance, position by
position up to where the greedy tokens part; and every decode step took the packed varlen path.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_sdpa_packed.py`."""
from __future__ import annotations

import random

import pytest
import torch

from _checkpoints import relative_error
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.kernels.attention import varlen_sdpa as sdpa_cuda

pytestmark = pytest.mark.gpu
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128)
ENGINE = dict(device="cuda", dtype="bfloat16", attention="sdpa", max_model_len=512, kv_block_size=16,
              num_kv_blocks=4096, max_num_batched_tokens=700)  # prompts of 700 tokens: chunked prefill too
GROUP = 5
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    return str(write_random_checkpoint(tmp_path_factory.mktemp("gpu-sdpa-packed") / "q3", **GPU_SHAPE))


def generate(model, small_buffer: bool, eager: bool, monkeypatch):
    from nanoplug import LLM, SamplingParams

    per_seq = 2 * ENGINE["max_model_len"] * GPU_SHAPE["num_key_value_heads"] * GPU_SHAPE["head_dim"] * 2
    if small_buffer:
        monkeypatch.setattr(sdpa_cuda, "packed_budget", lambda device: GROUP * per_seq)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(1, 500))] for _ in range(23)]
    cuda = {"enforce_eager": True} if eager else {"require_graphs": True}
    llm = LLM(model, cuda=cuda, **ENGINE)
    try:
        backend = llm.engine.worker.ctx.decode
        assert backend.cuda.packed is not None and backend.cuda.packed.group == (GROUP if small_buffer else 256)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_logits=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, dict(backend.paths), llm.engine.worker.report().stats
    finally:
        llm.close()
        monkeypatch.undo()


def test_groups_under_graphs_equal_one_group_eager(model, monkeypatch):
    grouped, paths, stats = generate(model, small_buffer=True, eager=False, monkeypatch=monkeypatch)
    whole, _, _ = generate(model, small_buffer=False, eager=True, monkeypatch=monkeypatch)
    decode_paths = {path for kind, path in paths if kind == "decode"}
    assert decode_paths == {"varlen, packed pages"}, paths
    assert ("prefill", "varlen, packed pages") in paths, paths  # a chunk over cached context
    assert stats.graph_replays > 0 and stats.eager_decode_steps == 0, stats
    compared = 0
    for a, b in zip(whole, grouped, strict=True):
        for i, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
            if a.token_ids[:i] != b.token_ids[:i]:
                break
            assert relative_error(lb.float(), la.float()) < 2.5e-2, (i, a.token_ids, b.token_ids)
            compared += 1
    assert compared >= len(whole) * MAX_TOKENS // 2, compared
