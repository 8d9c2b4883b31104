"""The `cpu` KV-cache store against `torch` in the default model's GGUF engine at batch 1 on CPU: both engines in
one process, greedy tokens compared, then 256-token generations alternately (which goes first alternates too),
ms a token of each and the best of each.

    python benchmarks/studies/cpu_kv_store.py [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch

from nanoplug import LLM, SamplingParams
from nanoplug.checkpoint.default_model import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(default_model_path())
    engines = {name: LLM(path, kv_cache=name, num_kv_blocks=64) for name in ("torch", "cpu")}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = ["Tell me a story about a cat."]
    tokens = {name: llm.generate(prompt, params, use_tqdm=False)[0].token_ids for name, llm in engines.items()}
    print("greedy tokens equal:", tokens["torch"] == tokens["cpu"])
    best = dict.fromkeys(engines, float("inf"))
    for r in range(args.rounds):
        for name in (("torch", "cpu") if r % 2 == 0 else ("cpu", "torch")):
            started = time.perf_counter()
            engines[name].generate(prompt, params, use_tqdm=False)
            ms = (time.perf_counter() - started) / args.tokens * 1e3
            best[name] = min(best[name], ms)
            print(f"round {r + 1} {name:5} {ms:.3f} ms a token", flush=True)
    print(f"best: torch {best['torch']:.3f}, cpu {best['cpu']:.3f} ms a token ({best['cpu'] / best['torch']:.3f}x)")


if __name__ == "__main__":
    main()
