"""The pre-quantized test checkpoints, written once per session by the libraries that define their formats
(nanoplug/bench/quantize.py) from one tiny random Qwen3, shared by test_quant_checkpoints.py and
test_random_quantized.py."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from _checkpoints import scratch_dir
from nanoplug.bench.checkpoints import write_random_checkpoint

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             tie_word_embeddings=False)  # every linear a whole number of 128-column groups and [128, 128] blocks


@lru_cache(maxsize=None)
def plain() -> Path:
    return write_random_checkpoint(scratch_dir("quant-plain"), "Qwen3ForCausalLM", seed=5, **SHAPE)


@lru_cache(maxsize=None)
def quantized(scheme: str, group_size: int = 128) -> Path:
    from nanoplug.bench.quantize import write_quantized_checkpoint

    # float32 scales: the engine computes in float32 as transformers does, so greedy tokens can be equal
    dtype = torch.float32 if scheme not in ("awq", "gptq") else torch.float16
    return write_quantized_checkpoint(plain(), scratch_dir(f"quant-{scheme}-{group_size}"), scheme, group_size, dtype)
