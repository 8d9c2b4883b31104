"""The seams later work plugs into, each proven by a small test-only plugin that plugs in without
editing the engine: a weight format (a `weight_format` plugin giving a LinearMethod), and a KV-cache
store that keeps K/V in another dtype than the model's. Each is compared with the plain engine."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from _checkpoints import PROMPTS, checkpoint, relative_error
from nanoplug import LLM, SamplingParams
from nanoplug.api import (PLUGIN_API_VERSION, KVCacheStore, LinearMethod, Target, WeightFormat, WeightShapeError,
                          check_shape, hookimpl)
from nanoplug.engine.registry import Registry

OPTIONS = dict(kv_block_size=16, num_kv_blocks=64, max_model_len=256, dtype="float32", device="cpu")


def plugin_module(name: str, kind: str, plugins: dict[str, type]) -> types.ModuleType:
    """A plugin module as a third party writes it: the API version and one registrar hook."""
    module = types.ModuleType(name)
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION

    def register_all(register):
        for plugin_name, cls in plugins.items():
            register.add(plugin_name, cls)

    setattr(module, f"nanoplug_register_{kind}", hookimpl(specname=f"nanoplug_register_{kind}")(register_all))
    return module


# ----------------------------------------------------------------------- weight format: int8
class Int8WeightOnly(LinearMethod):
    """Weight-only int8 with one float scale per output row, quantized as the checkpoint loads;
    embeddings stay dense (a tied LM head shares them, and then stays dense too)."""

    def create_weights(self, layer, input_size, output_size, dtype):
        if layer.role == "embedding":
            return super().create_weights(layer, input_size, output_size, dtype)
        layer.register_parameter("weight", torch.nn.Parameter(torch.empty(output_size, input_size, dtype=torch.int8),
                                                              requires_grad=False))
        layer.register_buffer("weight_scale", torch.ones(output_size, dtype=dtype), persistent=False)

    def load(self, layer, param, tensor, out_offset, out_size):
        if param.dtype != torch.int8:
            return super().load(layer, param, tensor, out_offset, out_size)
        check_shape(tensor, (out_size, param.shape[1]), "int8 rows")
        rows = tensor.float()
        scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
        param.data[out_offset:out_offset + out_size] = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
        layer.weight_scale[out_offset:out_offset + out_size] = scale.to(layer.weight_scale.dtype)

    def apply(self, layer, x, bias):
        if layer.weight.dtype != torch.int8:
            return F.linear(x, layer.weight, bias)
        y = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale
        return y + bias if bias is not None else y


class Int8Format(WeightFormat):
    description = "test-only weight-only int8 format"
    quantizes = True  # by name only

    def linear_method(self) -> LinearMethod:
        return Int8WeightOnly()


@pytest.fixture(scope="module")
def int8_registry():
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(plugin_module("int8_format", "weight_format", {"int8": Int8Format}), "test")
    return reg


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied"])
def test_an_int8_weight_format_plugs_in(int8_registry, name):
    path = checkpoint(name)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_logits=True)
    plain = LLM(path, registry=int8_registry, attention="sdpa", kv_cache="torch", **OPTIONS)
    int8 = LLM(path, registry=int8_registry, attention="sdpa", kv_cache="torch", quantization="int8", **OPTIONS)
    assert plain.choices["weight_format"].name == "dense"  # "auto" never picks a format that quantizes
    assert int8.choices["weight_format"].name == "int8" and int8.config.adapters == []
    model = int8.engine.worker.model
    layers = [m for m in model.modules() if getattr(m, "role", None) in ("linear", "lm_head")]
    quantized = [m for m in layers if m.weight.dtype == torch.int8]
    assert len(quantized) == len(layers) - (name == "qwen3_tied")  # a tied LM head shares the dense embedding
    assert not any(getattr(m, "packed", None) is not None for m in layers)  # the format's method, not the CPU's
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = int8.generate(PROMPTS, params, use_tqdm=False)
    equal = total = 0
    for a, b in zip(want, got):
        assert relative_error(b.logits[0], a.logits[0]) < 0.05  # the first token's logits: same inputs
        equal += sum(x == y for x, y in zip(a.token_ids, b.token_ids))
        total += len(a.token_ids)
    assert equal >= 0.75 * total, (equal, total)


def test_the_method_gets_each_fused_part_at_its_rows_and_a_wrong_shape_is_named():
    from nanoplug.api import Layers
    from nanoplug.plugins.parallel.single import LocalGroup

    torch.manual_seed(0)
    qkv = Layers(LocalGroup(), Int8WeightOnly()).qkv(16, 4, 4, 2, bias=True)
    parts = {"q": torch.randn(16, 16), "k": torch.randn(8, 16), "v": torch.randn(8, 16)}
    biases = {"q": torch.randn(16), "k": torch.randn(8), "v": torch.randn(8)}
    for shard in "qkv":
        qkv.weight_loader(qkv.weight, parts[shard], shard)
        qkv.weight_loader(qkv.bias, biases[shard], shard)
    x = torch.randn(3, 16)
    want = F.linear(x, torch.cat(list(parts.values())), torch.cat(list(biases.values())))
    assert qkv.weight.dtype == torch.int8 and relative_error(qkv(x), want) < 0.02
    with pytest.raises(WeightShapeError, match=r"shape \[9, 16\], but the model expects \[8, 16\] \(num_key_value_heads"):
        qkv.weight_loader(qkv.weight, torch.randn(9, 16), "k")
    with pytest.raises(WeightShapeError, match=r"shape \[8, 15\], but the model expects \[8, 16\]"):
        qkv.weight_loader(qkv.weight, torch.randn(8, 15), "k")


# ------------------------------------------------------------------ KV cache of another dtype
class BFloat16Store(KVCacheStore):
    """Keeps K/V in bfloat16 whatever the model's dtype: half the cache memory of float32."""

    description = "test-only bfloat16 cache"

    def cache_dtype(self, model_dtype):
        return torch.bfloat16

    def store(self, k, v, k_cache, v_cache, slot_mapping, layer):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@pytest.fixture(scope="module")
def bf16_registry():
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(plugin_module("bf16_store", "kv_cache", {"bf16": BFloat16Store}), "test")
    return reg


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_a_cache_of_another_dtype_is_read_by_the_backends(bf16_registry, attention):
    path = checkpoint("qwen3")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_logits=True)
    prompts = PROMPTS + [PROMPTS[2] + " And then"]  # a prefix-cache hit reads cached bfloat16 K/V
    plain = LLM(path, registry=bf16_registry, attention=attention, kv_cache="torch", max_num_batched_tokens=24, **OPTIONS)
    half = LLM(path, registry=bf16_registry, attention=attention, kv_cache="bf16", max_num_batched_tokens=24, **OPTIONS)
    assert half.engine.worker.kv_cache.dtype == torch.bfloat16 and plain.engine.worker.kv_cache.dtype == torch.float32
    want = plain.generate(prompts, params, use_tqdm=False)
    got = half.generate(prompts, params, use_tqdm=False)
    assert got[-1].num_cached_tokens > 0
    for a, b in zip(want, got):
        assert relative_error(b.logits[0], a.logits[0]) < 2e-2  # bfloat16 keeps about 3 significant digits
        assert a.token_ids[:2] == b.token_ids[:2]


def test_backends_that_cannot_read_the_cache_dtype_say_so(bf16_registry):
    from nanoplug.plugins.attention.cpu import CpuAttention

    facts = LLM(checkpoint("qwen3"), registry=bf16_registry, attention="sdpa", kv_cache="bf16", **OPTIONS).engine.facts
    target = Target(device=torch.device("cpu"), dtype=torch.float32, model=facts, kv_cache_dtype=torch.bfloat16)
    assert any("reads a float32 or float16 cache, not bfloat16" in r for r in CpuAttention.unavailable(target))
    assert bf16_registry.reasons("attention", "sdpa", target) == []


# ----------------------------------------------------------------------- platform: a zeroed KV cache
def test_a_platform_that_zeroes_its_cache_spares_the_step_the_clearing_of_new_blocks(monkeypatch):
    """A platform whose allocate_kv_cache returns zeros says so (`kv_cache_zeroed`), and the engine then
    clears no block before its first use; the default (uninitialized memory, NaN here) still clears them."""
    from _test_platforms import registry_with_platform
    from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

    class ZeroedCpu(CpuPlatform):
        description = "test-only: a CPU platform that allocates its KV cache zeroed"
        kv_cache_zeroed = True

        def allocate_kv_cache(self, shape, dtype, device):
            return torch.zeros(shape, dtype=dtype, device=device)

    allocate = CpuPlatform.allocate_kv_cache
    monkeypatch.setattr(CpuPlatform, "allocate_kv_cache",
                        lambda self, shape, dtype, device: allocate(self, shape, dtype, device).fill_(float("nan")))
    fills = []
    index_fill = torch.Tensor.index_fill_
    monkeypatch.setattr(torch.Tensor, "index_fill_", lambda self, *a: fills.append(a) or index_fill(self, *a))
    options = dict(OPTIONS, attention="sdpa", kv_cache="torch", registry=registry_with_platform("zeroed", ZeroedCpu))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(checkpoint(), **options) as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert fills, "the default platform's NaN-filled cache was not cleared before use"
    fills.clear()
    with LLM(checkpoint(), platform="zeroed", **options) as llm:
        zeroed = [o.token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert not fills, "blocks of a zeroed cache were cleared again"
    assert zeroed == plain
