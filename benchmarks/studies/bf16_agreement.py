"""The GPU quality gate's measures (tests/gpu/test_gpu_quality.py) on any device: the default model's real weights in
bf16 against transformers in float32, with transformers in bf16 as the bar: teacher-forced top-1 agreement over
benchmarks/data/apache-2.0.txt and greedy agreement over 32 prompts x 64 tokens, and where each prompt's tokens
first part from float32's. `--rounded` runs the engine as it was before the float32 residual stream and logits
(the stream rounded to bf16 after every layer, the logits rounded to bf16), to see what each is worth.

    python benchmarks/studies/bf16_agreement.py [--device cpu|cuda] [--rounded]

transformers' figures are cached in /tmp/bf16_agreement_<device>.pt (they take minutes on a CPU)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# the gate's own text, prompts and measure, so that the study and the test cannot drift apart
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from test_gpu_quality import NEW_TOKENS, TEXT, agreement, prompts_of  # noqa: E402


def first_parting(got: list[list[int]], want: list[list[int]]) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(got, want)]


@torch.no_grad()
def transformers_figures(folder: str, dtype: torch.dtype, device: str, ids: list[int], prompts: list[list[int]]):
    """(argmax at each position of the text, greedy tokens of each prompt one at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    top1 = model(torch.tensor([ids], device=device)).logits[0, :-1].float().argmax(-1).tolist()
    greedy = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device=device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
        greedy.append(out[0, len(p):].tolist())
    return top1, greedy


def round_as_before() -> None:
    """The engine as it was: residual stream of the model's dtype, logits rounded to it (one rank)."""
    import nanoplug.api.decoder as decoder
    from nanoplug.api import ParallelLMHead

    decoder.residual_stream = lambda hidden: hidden
    ParallelLMHead.forward = lambda self, hidden: self.linear_method.apply(self, hidden, None)[..., :self.vocab_size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounded", action="store_true", help="the stream and logits rounded to bf16, as before")
    args = parser.parse_args()
    from nanoplug import LLM, SamplingParams
    from nanoplug.checkpoint.default_model import default_model_path

    folder = str(default_model_path(progress=False, float32=True))
    if args.rounded:
        round_as_before()
    extra = dict(attention="flash") if args.device == "cuda" else {}
    llm = LLM(folder, dtype="bfloat16", device=args.device, max_model_len=4096, **extra)
    ids = llm.tokenizer.encode(TEXT.read_text())
    prompts = prompts_of(ids)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    ours_top1 = [p.top[0][0] for p in out.prompt_logprobs[1:]]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()

    cache = Path(f"/tmp/bf16_agreement_{args.device}.pt")
    if cache.exists():
        ref, bf16 = torch.load(cache)
    else:
        ref = transformers_figures(folder, torch.float32, args.device, ids, prompts)
        bf16 = transformers_figures(folder, torch.bfloat16, args.device, ids, prompts)
        torch.save((ref, bf16), cache)
    label = "nanoplug bf16" + (" (rounded as before)" if args.rounded else "")
    print(f"| engine | teacher-forced top-1 | greedy {len(prompts)} x {NEW_TOKENS} |")
    print(f"| {label} | {100 * agreement([ours_top1], [ref[0]]):.2f}% | {100 * agreement(ours, ref[1]):.2f}% |")
    print(f"| transformers bf16 | {100 * agreement([bf16[0]], [ref[0]]):.2f}% | {100 * agreement(bf16[1], ref[1]):.2f}% |")
    print("first token parting from float32's, by prompt:")
    print(f"  {label}: {first_parting(ours, ref[1])}")
    print(f"  transformers bf16: {first_parting(bf16[1], ref[1])}")


if __name__ == "__main__":
    main()
