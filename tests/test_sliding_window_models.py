"""Sliding-window models against transformers in float32 (tiny random checkpoints, windows of 8-12 tokens, so
the prompts are several windows long): Mistral (every layer windowed), Qwen2 with use_sliding_window
(max_window_layers: layer 0 full, layer 1 windowed) and Phi-3 (fused qkv/gate_up in the checkpoint), through
the paths the dense families take (mixed lengths in one batch, prefix-cache hits, chunked prefill,
preemption, both attention backends), and Gemma-3 (two local layers, then a global one with its own rope
base and linear scaling; q/k norms, four norms a layer, GeGLU, scaled embeddings, query_pre_attn_scalar and
final logit soft-capping set away from their defaults), and Gemma-2 (local and global layers in turn, one rope,
attention logit soft-capping, which every backend serving it applies and the others refuse). Each checkpoint's tokens differ from the same weights run with full
attention, so a window ignored anywhere would fail."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from _checkpoints import checkpoint, hf_logits, prompt_ids, relative_error
from nanoplug import SamplingParams
from test_engine_vs_hf import GREEDY, VARIANTS, cache_prompts, engine, reference, tokens_of

MODELS = ["mistral", "qwen2_swa", "phi3", "gemma3", "gemma2"]
# chunked prefill with prefix hits and preemption, through sdpa; the oracle and overlapped steps (slow: the
# machine of these tests is small) through manual
PATHS = ["chunks_of_13_sdpa", "preemption_chunks_sdpa"]
SLOW_PATHS = ["manual", "overlapped_steps"]


@lru_cache(maxsize=None)
def full_attention_tokens(name: str) -> list[list[int]]:
    """transformers' greedy tokens of the same weights with the window turned off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint(name))
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    else:
        config.sliding_window = None
    model = AutoModelForCausalLM.from_pretrained(checkpoint(name), config=config, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in cache_prompts(name):
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("name", MODELS)
def test_the_window_changes_the_tokens(name):
    assert reference(name, GREEDY.max_tokens, "cache") != full_attention_tokens(name)


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name):
    llm = engine(name, attention="sdpa")
    params = SamplingParams(temperature=0, max_tokens=4, output_logits=True, ignore_eos=True)
    prompts = prompt_ids(name) + cache_prompts(name)[5:6]  # the longest: several windows
    for ids, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        want = hf_logits(name, ids + out.token_ids[:-1])[len(ids) - 1:]
        assert relative_error(torch.stack(out.logits), want) < 1e-4, f"{name}: prompt of {len(ids)} tokens"


@pytest.mark.parametrize("name,variant", [(m, v) for m in MODELS for v in PATHS]
                         + [pytest.param(m, v, marks=pytest.mark.slow) for m in MODELS for v in SLOW_PATHS])
def test_greedy_equals_transformers(name, variant):
    options = VARIANTS[variant]
    llm = engine(name, **options)
    prompts = cache_prompts(name)
    want = reference(name, GREEDY.max_tokens, "cache")
    assert tokens_of(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    second = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix-cache hits now
    assert tokens_of(second) == want
    if llm.config.enable_prefix_caching:
        assert sum(o.num_cached_tokens for o in second) > 0
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.num_kv_blocks


def test_cpu_backend_decodes_windowed_layers_eagerly_and_equals_transformers():
    """`cpu` serves a windowed layer's decode through sdpa's gathered decode (its C++ kernel reads whole
    contexts), eager: that decode builds its index per step, which a CPU recording would not see."""
    from nanoplug.kernels import cpu as cpu_kernels

    if cpu_kernels.unavailable() is not None:
        pytest.skip(cpu_kernels.unavailable())
    llm = engine("mistral_dim64", attention="cpu")
    assert llm.engine.worker.graphs is None and llm.engine.worker.ctx.decode.window_decode is not None
    assert tokens_of(llm.generate(cache_prompts("mistral_dim64"), GREEDY, use_tqdm=False)) == reference(
        "mistral_dim64", GREEDY.max_tokens, "cache")


@torch.no_grad()
def uncapped_logits(name: str, ids: list[int]) -> torch.Tensor:
    """transformers' logits of the same weights with attention soft-capping turned off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint(name))
    config.attn_logit_softcapping = None
    model = AutoModelForCausalLM.from_pretrained(checkpoint(name), config=config, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).logits[0].float()


def test_gemma2_soft_capping_changes_the_tokens_and_the_backends_without_it_refuse():
    from nanoplug.api import ModelFacts, Target
    from nanoplug.engine.registry import Registry
    from transformers import AutoConfig

    ids = cache_prompts("gemma2")[5]  # (the logits test holds the engine to 1e-4 of the capped model)
    assert relative_error(uncapped_logits("gemma2", ids), hf_logits("gemma2", ids)) > 1e-2
    facts = ModelFacts.from_hf_config(AutoConfig.from_pretrained(checkpoint("gemma2")))
    assert facts.attn_softcap == 0.5
    registry = Registry(load_entry_points=False)
    for name in ("triton", "xformers"):
        reasons = registry.get("attention", name).unavailable(Target(torch.device("cuda"), torch.bfloat16, facts))
        assert any("attn_logit_softcapping" in r for r in reasons), (name, reasons)
