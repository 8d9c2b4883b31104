"""The `fp8` weight format (plugins/weight_formats/fp8.py) on CPU, where it takes its reference path:

- a layer's product equals quantize (e4m3, one scale per output row) - dequantize - F.linear exactly,
  and the quantized weight is within e4m3's half-ulp (2^-4 relative) of the original;
- an engine on the tiny Qwen3 checkpoint with quantization="fp8" generates, keeps its linear weights in
  float8, and its log-probabilities on a prompt stay within 0.05 nats (max abs) of the float32 engine's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _checkpoints import prompt_logprobs
from nanoplug import LLM, SamplingParams
from nanoplug.api import Layers
from nanoplug.plugins.weight_formats.fp8 import FP8, FP8LinearMethod, dequantize_rows, quantize_rows

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


class _Group:
    rank, world_size = 0, 1


def test_linear_equals_quantize_dequantize_then_f_linear():
    torch.manual_seed(0)
    method = FP8LinearMethod()
    layer = Layers(_Group(), method).column(48, 40, bias=True)
    w, b = torch.randn(40, 48) * 0.05, torch.randn(40)
    w[3] = 0  # a row of zeros keeps a finite scale
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (40,)
    q, scale = quantize_rows(w)
    ref = dequantize_rows(q, scale, torch.float32)
    assert torch.equal(dequantize_rows(layer.weight, layer.weight_scale, torch.float32), ref)
    assert ((ref - w).abs() <= w.abs().amax(dim=1, keepdim=True) * 2 ** -4).all()
    x = torch.randn(5, 48)
    assert torch.equal(layer(x), F.linear(x, ref, b))
    assert (layer(x)[:, 3] == b[3]).all()


def test_engine_with_fp8_weights_stays_close(qwen3_dir):
    options = dict(device="cpu", dtype="float32", kv_block_size=16, max_model_len=256, cpu={"kv_cache_gb": 0.05})
    fp8, dense = LLM(str(qwen3_dir), quantization="fp8", **options), LLM(str(qwen3_dir), **options)
    try:
        assert fp8.choices["weight_format"].name == "fp8" and fp8.config.adapters == []
        assert dense.choices["weight_format"].name == "dense"  # "auto" never quantizes plain weights
        layer = fp8.engine.worker.model.model.layers[0]
        assert layer.mlp.down_proj.weight.dtype == FP8 and layer.self_attn.qkv_proj.weight.dtype == FP8
        assert fp8.engine.worker.model.lm_head.weight.dtype == torch.float32  # embedding and head stay dense
        out = fp8.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
        assert len(out.token_ids) == 8
        ids = dense.tokenizer.encode("Once upon a time, in a small village, there lived an old clockmaker")
        diff = (prompt_logprobs(fp8, ids) - prompt_logprobs(dense, ids)).abs().max().item()
        assert diff < 0.05, diff
    finally:
        fp8.close()
        dense.close()
