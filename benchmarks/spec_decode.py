"""Speculative decoding on the input-grounded workload (benchmarks/data/spec_decode_workload.jsonl: summarise,
extract and edit texts given in the prompt): output tokens/s of each speculator against no speculation, at
batch 1 (the prompts one at a time) and at a large batch (all at once), greedy, with the acceptance rate and
mean accepted length of each, and whether its tokens are exactly the plain engine's.

Variants: `none`; `ngram` (adaptive k); `ngram-fixed` (always k drafts, as vLLM); `draft` (the model drafting for
itself: every draft should be kept, a correctness bound). Engines are built once and measured alternately,
best of --repeats (the machine may be shared).

    python benchmarks/spec_decode.py                                  # CPU, the default model's GGUF
    python benchmarks/spec_decode.py --device cuda --dtype bfloat16   # one GPU, the default model in bf16
    python benchmarks/spec_decode.py --tiny --max-tokens 8 --batches 1,4 --prompts 2   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parent / "data" / "spec_decode_workload.jsonl"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 checkpoint (a smoke run)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention", default="auto")
    p.add_argument("--variants", default="none,ngram,ngram-fixed,draft")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompts", type=int, default=6, help="workload prompts run one at a time at batch 1")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=1024)
    return p.parse_args()


def model_path(args) -> str:
    if args.tiny:
        from nanoplug.bench.checkpoints import write_random_checkpoint

        return str(write_random_checkpoint(Path("/tmp/nanoplug-spec-tiny"), "Qwen3ForCausalLM"))
    if args.model:
        return args.model
    from nanoplug.checkpoint.default_model import default_model_path

    return str(default_model_path(progress=True, float32=args.device.startswith("cuda")))  # bf16 on a GPU


def engine(path: str, variant: str, args):
    from nanoplug import LLM

    options = dict(device=args.device, dtype=args.dtype, attention=args.attention, max_model_len=args.max_model_len,
                   max_num_seqs=max(int(b) for b in args.batches.split(",")))
    if args.device == "cuda":  # every variant's engine lives at once (alternated); memory_utilization caps the
        variants = args.variants.split(",")  # process's whole use, so each next engine is given a larger cap
        options["cuda"] = {"memory_utilization": 0.85 * (variants.index(variant) + 1) / len(variants)}
    if variant != "none":
        name = variant.removesuffix("-fixed")
        options.update(speculator=name, num_speculative_tokens=args.k, adaptive_speculation=not variant.endswith("-fixed"))
        if name == "draft":
            options["speculator_options"] = {"model": path}
    return LLM(path, **options)


def prompts_of(llm, rows: list[dict], tiny: bool) -> list[list[int]]:
    if tiny:  # a random model has no chat template worth the name: the texts themselves
        return [llm.engine.make_request(r["prompt"]).prompt_token_ids for r in rows]
    return [llm.engine.chat_prompt_ids([{"role": "user", "content": r["prompt"]}]) for r in rows]


def run_once(llm, prompts: list[list[int]], batch: int, max_tokens: int):
    """(seconds, output tokens, token ids, spec stats) of one run: prompts one at a time at batch 1, else at once."""
    from nanoplug import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    spec = llm.engine.speculation
    if spec is not None:
        spec.stats = type(spec.stats)()
    start = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([prompts[i % len(prompts)] for i in range(batch)], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ids = [o.token_ids for o in outs]
    return seconds, sum(map(len, ids)), ids, (spec.stats if spec is not None else None)


def main() -> None:
    args = parse_args()
    rows = [json.loads(line) for line in WORKLOAD.read_text().splitlines() if line.strip()]
    path = model_path(args)
    variants = args.variants.split(",")
    engines = {}
    for v in variants:
        started = time.perf_counter()
        engines[v] = engine(path, v, args)
        print(f"{v}: engine ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    prompts = prompts_of(engines[variants[0]], rows, args.tiny)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        chosen = prompts[:args.prompts] if batch == 1 else prompts
        best: dict[str, tuple] = {}
        for llm in engines.values():  # warm-up
            run_once(llm, chosen[:1], 1, 4)
        for _ in range(args.repeats):
            for v, llm in engines.items():  # alternated, so a busy moment of a shared machine hits all alike
                got = run_once(llm, chosen, batch, args.max_tokens)
                print(f"batch {batch} {v}: {got[1]} tokens in {got[0]:.2f} s", file=sys.stderr, flush=True)
                if v not in best or got[0] < best[v][0]:
                    best[v] = got
        base_s, base_n, base_ids, _ = best["none"] if "none" in best else best[variants[0]]
        for v in variants:
            seconds, n, ids, stats = best[v]
            results.append(dict(
                batch=batch, variant=v, tokens=n, seconds=round(seconds, 3), tokens_per_s=round(n / seconds, 1),
                speedup=round((n / seconds) / (base_n / base_s), 3), identical=ids == base_ids,
                acceptance_rate=round(stats.acceptance_rate, 3) if stats else None,
                mean_accepted_length=round(stats.mean_accepted_length, 3) if stats else None,
                verifications=stats.verifications if stats else None))
    import torch

    machine = (torch.cuda.get_device_name() if args.device.startswith("cuda") else
               f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads "
               f"{torch.get_num_threads()}")
    print(json.dumps({"model": path, "device": args.device, "machine": machine, "k": args.k,
                      "max_tokens": args.max_tokens, "results": results}))
    print(f"\n{'batch':>5} {'variant':<12} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'mean len':>8} {'same':>5}")
    for r in results:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"{r['batch']:>5} {r['variant']:<12} {r['tokens_per_s']:>8.1f} {r['speedup']:>7.2f}x {acc:>7} {mal:>8} "
              f"{'yes' if r['identical'] else 'NO':>5}")


if __name__ == "__main__":
    main()
