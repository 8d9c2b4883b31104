"""Model plugin `llama` (LlamaForCausalLM) against Hugging Face transformers, float32.

Tiny random Llama checkpoints written with transformers' own LlamaConfig/save_pretrained cover
SmolLM2's settings (tied embeddings, 3 query heads per KV head, rope theta 1e5), the Llama 3 rope
scaling (rope_type llama3, with prompts longer than its original context so the scaled
frequencies matter) and the optional attention/MLP biases. Each must give transformers' logits
(within 1e-4 relative) at the prefill and every decode step, and its greedy tokens.
"""
from __future__ import annotations

import pytest
import torch

from _checkpoints import PROMPTS, relative_error
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import write_random_checkpoint

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32, rope_theta=500000.0)
VARIANTS = {
    # SmolLM2-135M in miniature: tied embeddings, GQA 6:2, rope theta 1e5, no bias
    "smollm2_like": dict(tie_word_embeddings=True, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                         rope_parameters=dict(rope_type="default", rope_theta=100000.0), seed=11),
    "llama3_rope": dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE, seed=12),
    "biases": dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, seed=13),
}
LONG = (
    "Rivers shape the land they cross: they carve valleys, carry sediment to the sea and build deltas, "
    "and over many thousands of years they move their beds across whole plains, leaving lakes behind."
)
NEW_TOKENS = 10


@pytest.fixture(scope="session")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    dirs = {}
    for name, shape in VARIANTS.items():
        shape = dict(shape)
        seed = shape.pop("seed")
        dirs[name] = str(write_random_checkpoint(root / name, "LlamaForCausalLM", seed=seed, **shape))
    return dirs


@pytest.fixture(scope="session")
def hf_models(llama_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dirs["smollm2_like"])
    models = {n: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for n, d in llama_dirs.items()}
    prompts = [tok.encode(p) for p in PROMPTS + [LONG]]
    assert max(map(len, prompts)) + NEW_TOKENS > LLAMA3_ROPE["original_max_position_embeddings"]
    return models, prompts


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def engine(path: str, attention: str) -> LLM:
    return LLM(path, attention=attention, kv_cache="torch", kv_block_size=16, num_kv_blocks=64, max_model_len=256)


def test_llama3_rope_scaling_is_applied(llama_dirs):
    """The llama3 rope type really changes the frequencies (so the logits test below exercises it)."""
    from transformers import AutoConfig

    from nanoplug.api import rope_inv_freq

    cfg = AutoConfig.from_pretrained(llama_dirs["llama3_rope"])
    scaled, _ = rope_inv_freq(cfg, 16)
    plain = 1.0 / (LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(scaled[:1], plain[:1])  # wavelengths under original_max / high_freq_factor: untouched
    assert torch.allclose(scaled[-2:], plain[-2:] / LLAMA3_ROPE["factor"])  # long wavelengths: divided by factor


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_logits_and_greedy_equal_transformers(llama_dirs, hf_models, variant, attention):
    models, prompts = hf_models
    model = models[variant]
    llm = engine(llama_dirs[variant], attention)
    assert llm.choices["model"].name == "LlamaForCausalLM"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, output_logits=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, ids, NEW_TOKENS), (variant, attention, ids)
        full = torch.tensor([ids + out.token_ids[:-1]])
        with torch.no_grad():
            want = model(full).logits[0, len(ids) - 1:].float()  # prefill's last row, then each decode step
        got = torch.stack(out.logits)
        assert got.shape == want.shape
        assert relative_error(got, want) < 1e-4, (variant, attention, relative_error(got, want))
