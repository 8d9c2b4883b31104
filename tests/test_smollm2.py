"""The embedded default model, SmolLM2-135M-Instruct (converted once into the per-user cache), against
transformers on the same folder: greedy 32-token continuations of 5 prompts, token for token, float32,
eos ignored on both sides; in one batch on the fast path (`sdpa`) and on the oracle (`manual`).
"""
from __future__ import annotations

import pytest
import torch

from nanoplug import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, a little robot",
    "The three primary colors are",
    "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_dir():
    from nanoplug.checkpoint.default_model import default_model_path

    return str(default_model_path(progress=True, float32=True))


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """transformers' greedy tokens for each prompt, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id)
            outs.append(out[0, len(ids):].tolist())
    return prompts, outs, tok


@pytest.mark.parametrize("attention,cpu_kernels", [
    ("cpu", True),  # the C++ decode kernel and fused ops (the default where a compiler is found)
    ("sdpa", False),  # plain torch ops only
    ("manual", None),
])
def test_greedy_equals_transformers(smollm2_dir, reference, attention, cpu_kernels):
    prompts, want, tok = reference
    llm = LLM(smollm2_dir, attention=attention, kv_cache="torch", kv_block_size=16, max_model_len=256,
              cpu={"kv_cache_gb": 0.25, "kernels": cpu_kernels})
    assert llm.choices["model"].name == "LlamaForCausalLM"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out, ref in zip(PROMPTS, outs, want):
        assert out.token_ids == ref, f"{attention}: {prompt!r}\n got  {tok.decode(out.token_ids)!r}\n want {tok.decode(ref)!r}"
    assert "Paris" in outs[0].text


def test_eos_ids_and_chat_stream(smollm2_dir):
    """Both SmolLM2 end tokens stop a request; a chat answer streams and stops at <|im_end|>."""
    llm = LLM(smollm2_dir, kv_block_size=16, max_model_len=256, cpu={"kv_cache_gb": 0.25})
    assert llm.eos_token_ids == {0, 2}
    ids = llm.chat_prompt_ids([{"role": "user", "content": "What is the capital of France?"}])
    deltas = list(llm.stream(ids, SamplingParams(temperature=0, max_tokens=48)))
    text = "".join(d.text for d in deltas)
    assert "Paris" in text and "<|im_end|>" not in text
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop" and deltas[-1].token_ids == [2]
