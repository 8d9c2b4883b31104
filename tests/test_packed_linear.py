"""Linear weights packed once on the CPU (`cpu={"weight_packing": ...}`, the cpu platform's linear method), for
nanoplug's own GEMM (its C++ kernels) and for MKL's: each packed GEMM must give F.linear's result at every
row count, the engine's tokens and logits must not change, packing must follow LoRA merges, and it
must stay off where it cannot serve or does not fit."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _checkpoints import PROMPTS, checkpoint
from nanoplug import LLM, SamplingParams
from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.plugins.platforms.cpu import packed_linear
from nanoplug.plugins.platforms.cpu.packed_linear import MAX_ROWS, MKL_MIN_ROWS, PackedWeight, linear, pack_linear_weights

CPU, F32 = torch.device("cpu"), torch.float32
OPTIONS = dict(kv_block_size=16, attention="sdpa", kv_cache="torch", num_kv_blocks=64, max_model_len=256)


class Probe(nn.Module):
    packed = None

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(out_features, in_features, generator=gen), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(out_features, generator=gen), requires_grad=False)


def packed_layers(llm: LLM) -> list[nn.Module]:
    return [m for m in llm.engine.worker.model.modules() if getattr(m, "packed", None) is not None]


@pytest.fixture(params=["nanoplug", "mkl"])
def gemm(request):
    """The kernels argument of pack_linear_weights: nanoplug's GEMM, or None for MKL's."""
    return cpu_kernels.kernels() if request.param == "nanoplug" else None


def test_packed_gemm_equals_f_linear_at_every_row_count(gemm):
    probe = Probe(200, 72)
    assert pack_linear_weights(probe, True, F32, CPU, gemm) == 200 * 72 * 4
    assert probe.packed is not None
    for rows in range(1, MAX_ROWS + 9):
        x = torch.randn(rows, 72)
        torch.testing.assert_close(linear(x, probe.weight, probe.bias, probe.packed), F.linear(x, probe.weight, probe.bias),
                                   rtol=1e-5, atol=1e-5)
    wide = torch.randn(MKL_MIN_ROWS + 4, 100)
    for x in (wide[:, :72], wide[:, 28:], torch.randn(72, 9).t()):  # strided views, as split/transpose give
        torch.testing.assert_close(linear(x, probe.weight, probe.bias, probe.packed), F.linear(x, probe.weight, probe.bias),
                                   rtol=1e-5, atol=1e-5)


def test_only_decode_sized_inputs_take_the_packed_path(gemm):
    probe = Probe(16, 8)
    pack_linear_weights(probe, True, F32, CPU, gemm)
    calls = []
    real = probe.packed.mm
    probe.packed = probe.packed._replace(mm=lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, MKL_MIN_ROWS - 1, MKL_MIN_ROWS, MAX_ROWS, MAX_ROWS + 1, 500):
        linear(torch.randn(rows, 8), probe.weight, probe.bias, probe.packed)
    # nanoplug's GEMM serves 2-64 rows, MKL's 4-64; one row takes F.linear's matrix-vector path
    assert calls == ([MKL_MIN_ROWS - 1] if gemm is not None else []) + [MKL_MIN_ROWS, MAX_ROWS]


@pytest.fixture(scope="module")
def engines():
    return {"plain": LLM(checkpoint(), **OPTIONS, cpu={"weight_packing": False}),
            "nanoplug": LLM(checkpoint(), **OPTIONS, cpu={"weight_packing": True}),  # the kernels: on where they build
            "mkl": LLM(checkpoint(), **OPTIONS, cpu={"weight_packing": True, "kernels": False})}


@pytest.mark.parametrize("packed", ["nanoplug", "mkl"])
def test_engine_tokens_and_logits_unchanged_by_packing(engines, packed):
    plain, engine = engines["plain"], engines[packed]
    assert not packed_layers(plain)
    layers = packed_layers(engine)
    assert any(type(m).__name__ == "ParallelLMHead" for m in layers) and len(layers) > 4
    want = cpu_kernels.kernels().linear if packed == "nanoplug" else packed_linear._mkl_mm
    assert all(m.packed.mm == want for m in layers)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_logits=True)
    prompts = PROMPTS * 3  # 12 sequences: decode steps of 12 rows take the packed path
    for a, b in zip(plain.generate(prompts, params, use_tqdm=False), engine.generate(prompts, params, use_tqdm=False)):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_packing_follows_the_lora_merge():
    from test_lora import peft_lora  # a PEFT LoRA folder, made by PEFT

    llm = LLM(checkpoint("qwen3"), **OPTIONS, adapters=[peft_lora("qwen3", seed=1)], cpu={"weight_packing": True})
    layers = packed_layers(llm)
    assert layers
    x = torch.randn(MKL_MIN_ROWS + 3, layers[0].weight.shape[1])
    for m in layers:  # the packed copy is of the merged weight, not of the checkpoint's
        if m.weight.shape[1] == x.shape[1]:
            torch.testing.assert_close(m.packed.mm(x, m.packed.data, m.weight, None), F.linear(x, m.weight),
                                       rtol=1e-5, atol=1e-5)


def test_auto_packs_only_where_it_serves_and_fits(monkeypatch):
    probe = Probe(64, 32)
    assert pack_linear_weights(probe, None, torch.bfloat16, CPU) == 0  # float32 only
    assert pack_linear_weights(probe, False, F32, CPU) == 0
    monkeypatch.setattr(packed_linear, "_available_memory", lambda: 4 * 64 * 32 * 4 - 1)
    assert pack_linear_weights(probe, None, F32, CPU) == 0 and probe.packed is None  # would not fit a quarter
    monkeypatch.setattr(packed_linear, "_available_memory", lambda: 4 * 64 * 32 * 4)
    assert pack_linear_weights(probe, None, F32, CPU) > 0 and probe.packed is not None
    bf16 = LLM(checkpoint(), **OPTIONS, dtype="bfloat16")
    assert not packed_layers(bf16)


def test_a_disagreeing_packed_gemm_is_not_used(monkeypatch, caplog):
    probe = Probe(64, 32)
    wrong = lambda x, packed, weight, bias: torch.zeros(x.shape[0], weight.shape[0])  # noqa: E731
    monkeypatch.setattr(packed_linear, "_packer", lambda kernels: lambda w: PackedWeight(w, wrong, 1, MAX_ROWS))
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        assert pack_linear_weights(probe, True, F32, CPU) == 0
    assert probe.packed is None and "disagreed" in caplog.text
