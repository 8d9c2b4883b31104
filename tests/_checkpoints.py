"""Tiny random checkpoints and the transformers references the engine tests compare against.

Each checkpoint is written once per test process (into one temporary folder removed at exit), so
every test module can ask for the same ones without paying for `save_pretrained` twice.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from nanoplug.bench.checkpoints import write_random_checkpoint

# name -> (architecture, shape overrides of nanoplug.bench.checkpoints.TINY_SHAPE)
CHECKPOINTS = {
    "qwen3": ("Qwen3ForCausalLM", dict(tie_word_embeddings=False)),  # GQA: 4 heads over 2 KV heads
    "qwen3_tied": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, seed=1)),
    # a vocabulary of 512 (prompts as token ids): sampling tests that draw thousands of tokens stay cheap
    "qwen3_vocab512": ("Qwen3ForCausalLM", dict(tie_word_embeddings=False, vocab_size=512, pad_token_id=None,
                                                  eos_token_id=511, seed=7)),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False, seed=2)),  # q/k/v bias, no q/k norm
    "qwen2_tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1, seed=3)),
    # mixture of experts (tests/test_moe_models.py): 8 experts, 2 a token; layer 1 of qwen3_moe dense (mlp_only_layers),
    # qwen2_moe's layer 0 dense (decoder_sparse_step 2) and its shared expert; Mixtral renormalises over the top 2
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                                              tie_word_embeddings=False, seed=4)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, norm_topk_prob=False,
                                              decoder_sparse_step=2, tie_word_embeddings=False, seed=5)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48,
                                           tie_word_embeddings=False, seed=6)),
    # sliding windows of a few tokens, so that the tests' prompts are several windows long
    "mistral": ("MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=8, seed=20)),
    "qwen2_swa": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=1, seed=21)),  # layer 0 full, layer 1 windowed
    "phi3": ("Phi3ForCausalLM", dict(tie_word_embeddings=False, sliding_window=12, seed=22)),
    "mistral_dim64": ("MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=8, hidden_size=128,
                                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                                 seed=24)),  # a head size the C++ decode kernel takes
    "qwen2_swa_dim64": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                                                 max_window_layers=1, hidden_size=128, num_attention_heads=2,
                                                 num_key_value_heads=1, head_dim=64, seed=26)),  # KV groups, cpu kernel
    # two local layers (window 8, rope base 10k) then a global one (base 1e6, linear scaling 2), q scale 1/sqrt(24)
    "gemma3": ("Gemma3ForCausalLM", dict(
        tie_word_embeddings=True, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        seed=23)),
    # local and global layers in turn (window 8), attention scores capped at 0.5 (tiny random scores would never
    # reach Gemma-2's 50), final logits at 30, q scale 1/sqrt(24)
    "gemma2": ("Gemma2ForCausalLM", dict(
        tie_word_embeddings=True, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=0.5, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2, seed=25)),
}

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about the sea.",
    "1, 2, 3, 4,",
]


@lru_cache(maxsize=None)
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="nanoplug-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@lru_cache(maxsize=None)
def checkpoint(name: str = "qwen3") -> str:
    """The folder of a tiny random checkpoint (see CHECKPOINTS), written on first use."""
    architecture, shape = CHECKPOINTS[name]
    shape = dict(shape)
    seed = shape.pop("seed", 0)
    return str(write_random_checkpoint(_root() / name, architecture, seed=seed, **shape))


def scratch_dir(name: str) -> Path:
    """A fresh folder under the session's temporary root, for tests that write their own files."""
    folder = _root() / name
    folder.mkdir(parents=True, exist_ok=False)
    return folder


@lru_cache(maxsize=None)
def hf_model(name: str = "qwen3"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32).eval()


@lru_cache(maxsize=None)
def tokenizer(name: str = "qwen3"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint(name))


def prompt_ids(name: str = "qwen3", prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [tokenizer(name).encode(p) for p in prompts]


@torch.no_grad()
def hf_greedy(name: str, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` for one prompt (no padding, so nothing blurs the tokens)."""
    model = hf_model(name)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def hf_logits(name: str, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `ids`: [len(ids), vocab]."""
    return hf_model(name)(torch.tensor([ids])).logits[0].float()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference magnitude."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def prompt_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log-softmax rows [len(ids) - 1, vocab] (float64) predicting ids[1:]: the hidden state of every prompt
    position, captured as the prefill computes it, through the model's own LM head (256 rows at a time).
    The request asks for prompt logprobs so that its prefill runs eager (a replayed CUDA graph calls no hooks)."""
    from nanoplug import SamplingParams

    model, hidden = llm.engine.worker.model, []
    hook = model.register_forward_hook(lambda m, args, out: hidden.append(out.detach().clone()))
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        hook.remove()
    rows = torch.cat(hidden)[: len(ids) - 1]
    with torch.inference_mode():
        logits = torch.cat([model.compute_logits(rows[i:i + 256]) for i in range(0, len(rows), 256)])
    return torch.log_softmax(logits.double(), dim=-1)
