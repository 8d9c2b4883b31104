"""The two engines the CPU benchmarks race, behind one `generate(prompts, new_tokens)`, and the text
their prompts are cut from. Both generate greedily with EOS ignored (an EOS is a token like any other),
so equal engines give equal tokens."""
from __future__ import annotations

import argparse

import torch

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press into a system that could produce books quickly. "
    "Before that, texts were copied by hand, which made them expensive and rare. Within a few decades, "
    "printing shops had spread across Europe, and the number of books grew from thousands to millions. "
    "Scholars could compare identical copies, news travelled faster, and literacy slowly rose. "
    "Rivers shape the land they cross: they carve valleys, carry sediment to the sea and build deltas. "
    "A recipe for bread needs only flour, water, salt and yeast, yet bakers argue about every step. "
)


def parse_args(parser) -> "argparse.Namespace":
    """Add the options both CPU races share, parse, and apply --threads."""
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--attention", default="cpu", help="nanoplug's attention backend (cpu: the C++ decode kernel)")
    parser.add_argument("--kv-cache", default="torch")
    parser.add_argument("--no-weight-packing", action="store_true",
                        help="nanoplug with F.linear on the unpacked weights (cpu={'weight_packing': False})")
    parser.add_argument("--no-cpu-kernels", action="store_true",
                        help="nanoplug's RMSNorm, SiLU-and-mul and RoPE in eager torch ops (cpu={'kernels': False})")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def nanoplug_options(args) -> dict:
    """The engine options those shared arguments choose."""
    return dict(attention=args.attention, kv_cache=args.kv_cache,
                cpu={"weight_packing": False if args.no_weight_packing else None,
                     "kernels": False if args.no_cpu_kernels else None})


class Nanoplug:
    def __init__(self, path: str, **options):
        from nanoplug import LLM

        self.llm = LLM(path, **options)
        self.label = f"nanoplug ({options.get('attention', 'auto')}, {options.get('kv_cache', 'auto')})"

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from nanoplug import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        return [o.token_ids for o in self.llm.generate(prompts, params, use_tqdm=False)]


class Transformers:
    def __init__(self, path: str, dtype: str = "float32", label: str = "transformers generate"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.label = label

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, prompts))  # left padding, as batched generation needs
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, width:].tolist()
