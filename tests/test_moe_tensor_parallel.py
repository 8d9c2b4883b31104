"""Tensor parallelism of the MoE models on CPU (gloo, two ranks): every expert sharded as the dense MLP is (gate
and up by rows, down by columns, one all-reduce), the shared expert and the dense layers as MLPs; logits and
tokens equal to one process's."""
from __future__ import annotations

import pytest
import torch

import tensor_parallel_helpers as helpers
from _checkpoints import checkpoint
from nanoplug import LLM


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_tp2_matches_one_process(name):
    single = helpers.generate_twice(LLM(checkpoint(name), parallel="single", **helpers.ENGINE_OPTIONS))
    with LLM(checkpoint(name), parallel="tensor", tensor_parallel_size=2, **helpers.ENGINE_OPTIONS) as tp:
        rounds = helpers.generate_twice(tp)
    for ref_outs, outs in zip(single, rounds):
        for ref, out in zip(ref_outs, outs):
            assert out.token_ids == ref.token_ids
            for a, b in zip(ref.logits, out.logits):
                assert float((a - b).abs().max() / a.abs().max()) <= 1e-5
    assert sum(o.num_cached_tokens for o in rounds[1]) > 0
