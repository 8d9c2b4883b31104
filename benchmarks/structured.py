"""Structured outputs: JSONSchemaBench's schemas through each backend, and what the constraint costs.

1. compile: every schema of /work/shared/data/jsonschemabench (400: Glaiveai2K, Github_easy, Github_trivial)
   by each backend; accepted / refused counts, the refusals' messages grouped, compile time median and p99.
2. generate: for the accepted schemas (all, or --sample N of them), the model's output at temperature 0 under
   the schema, --max-tokens at most: how many finish with "stop", and of those how many validate with
   `jsonschema` (must be all).
3. mask: the per-token cost of the mask on the host, each output of 2 replayed through a fresh matcher
   (fill the mask, accept the token): median and p99 per backend.
4. e2e: time per output token with a JSON schema against none, batch 1 and 64, temperature 0.8, 256 tokens a
   sequence at most, in pairs of runs, each free run's sequences as long as the schema run's before it (EOS
   ignored); and the first request of a new schema's extra time to first token (its compile).

    python benchmarks/structured.py                        # CPU, the embedded default model, every part
    python benchmarks/structured.py --device cuda --model random-0.6b --parts e2e --backends xgrammar  # one H200
    python benchmarks/structured.py --parts compile,generate --sample 40 --backends llguidance
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

DATA = Path("/work/shared/data/jsonschemabench")
E2E_SCHEMA = "Github_easy/o11173.json"  # (JSONSchemaBench's WashingtonPost set is not in the shared data)


def load_schemas(root: Path = DATA) -> list[tuple[str, dict]]:
    return [(f"{p.parent.name}/{p.name}", json.loads(p.read_text())) for p in sorted(root.glob("*/*.json"))]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def validates(schema: dict, text: str) -> str | None:
    """None when `text` is JSON that `schema` accepts, else why not."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        jsonschema.validators.validator_for(schema)(schema).validate(value)
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message[:200]}"
    except jsonschema.SchemaError as exc:
        return f"the schema itself is invalid: {exc.message[:200]}"
    return None


def compile_all(llm, schemas) -> tuple[list[str], dict[str, str], list[float]]:
    from nanoplug.api import ConstraintError, Constraint

    structured = llm.engine.structured
    accepted, refused, seconds = [], {}, []
    for name, schema in schemas:
        started = time.perf_counter()
        try:
            structured.compiled(Constraint("json", json.dumps(schema, ensure_ascii=False)))
        except ConstraintError as exc:
            refused[name] = str(exc)
            continue
        seconds.append(time.perf_counter() - started)
        accepted.append(name)
    return accepted, refused, seconds


def generate_all(llm, schemas, names, max_tokens) -> tuple[dict[str, list[int]], Counter, list[str]]:
    from nanoplug import SamplingParams

    by_name = dict(schemas)
    prompts, params = [], []
    for name in names:
        schema = by_name[name]
        prompts.append(f"<|im_start|>user\nWrite a JSON object that follows this schema:\n{json.dumps(schema)[:1500]}"
                       "<|im_end|>\n<|im_start|>assistant\n")
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"json": schema}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    counts, problems, tokens = Counter(), [], {}
    for name, out in zip(names, outs):
        o = out.outputs[0]
        tokens[name] = o.token_ids
        counts[o.finish_reason] += 1
        if o.finish_reason == "stop":
            why = validates(by_name[name], o.text)
            counts["valid" if why is None else "invalid"] += 1
            if why is not None:
                problems.append(f"{name}: {why}: {o.text[:200]!r}")
    return tokens, counts, problems


def mask_costs(llm, schemas, tokens) -> list[float]:
    """Seconds per token of fill_mask + accept, each output replayed through a fresh matcher."""
    import numpy as np

    from nanoplug.api import Constraint, bitmask_words

    structured = llm.engine.structured
    backend = structured._backend()
    by_name = dict(schemas)
    bitmask = np.empty((1, bitmask_words(structured.vocab_size)), dtype=np.int32)
    costs = []
    for name, ids in tokens.items():
        matcher = backend.matcher(structured.compiled(Constraint("json", json.dumps(by_name[name], ensure_ascii=False))))
        for token in ids:
            started = time.perf_counter()
            matcher.fill_mask(bitmask, 0)
            ok = matcher.accept(token)
            costs.append(time.perf_counter() - started)
            if not ok or matcher.terminated:
                break
    return costs


def e2e(llm, schema: dict, batch: int, max_tokens: int, repeats: int) -> dict[str, float]:
    """ms per output token with the schema and without (same prompts, temperature 0.8), `repeats` pairs of runs,
    the schema's run first; the median run of each variant is kept.

    A schema's sequences end when their grammar does, most before max_tokens, and once some have ended a step
    runs fewer sequences in about the same time. So the free run of a pair gives its sequences the lengths of the
    schema run before it (ignore_eos): the same tokens in the same shrinking batch, so the difference is the
    constraint's cost.
    (Against free sequences all of max_tokens, the schema was also charged for its shorter outputs: about +4%
    at batch 64 on the random model.)"""
    from nanoplug import SamplingParams

    prompt = ("<|im_start|>user\nWrite a JSON object about a news article.<|im_end|>\n<|im_start|>assistant\n")
    runs: dict[str, list[float]] = {"none": [], "schema": []}
    tokens: dict[str, int] = {}

    def run(label: str, lengths: list[int]) -> list[int]:
        if label == "none":
            params = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in lengths]
        else:
            params = [SamplingParams(temperature=0.8, max_tokens=max_tokens, structured_outputs={"json": schema})
                      for _ in range(batch)]
        started = time.perf_counter()
        outs = llm.generate([prompt] * batch, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        got = [len(o.outputs[0].token_ids) for o in outs]
        runs[label].append(1000 * seconds / (sum(got) / batch))  # ms per step-token of one sequence
        tokens[label] = sum(got)
        return got

    run("none", run("schema", [max_tokens] * batch))  # warm both (the schema's grammar compiled)
    runs["none"].clear()
    runs["schema"].clear()
    for _ in range(repeats):  # (so the runs alternate too)
        run("none", [max(1, n) for n in run("schema", [max_tokens] * batch)])
    out = {label: statistics.median(v) for label, v in runs.items()}
    out.update({f"{label}_tokens": n for label, n in tokens.items()})
    out.update({f"{label}_runs": v for label, v in runs.items()})
    return out


def first_request(llm, schema: dict) -> dict[str, float]:
    """Time to first token of a request with a schema never seen, and of the same request again (cached)."""
    from nanoplug import SamplingParams

    schema = {**schema, "title": f"fresh-{time.time_ns()}"}  # a new text: not in the cache
    params = SamplingParams(temperature=0, max_tokens=1, structured_outputs={"json": schema})
    prompt = "<|im_start|>user\nJSON please.<|im_end|>\n<|im_start|>assistant\n"
    times = []
    for _ in range(2):
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return {"first_s": times[0], "cached_s": times[1], "extra_ms": 1000 * (times[0] - times[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model); "
                   "'random-0.6b': the bench's random Qwen3-0.6B-shape bf16 checkpoint (nanoplug.bench.throughput)")
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: the checkpoint's on GPU)")
    p.add_argument("--repeats", type=int, default=3, help="e2e: alternating runs of each variant")
    p.add_argument("--backends", default="xgrammar,llguidance")
    p.add_argument("--parts", default="compile,generate,mask,e2e")
    p.add_argument("--sample", type=int, default=0, help="generate for every k-th accepted schema, k chosen to "
                   "give this many (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--e2e-tokens", type=int, default=256)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--no-graphs", action="store_true", help="CPU: no recorded decode steps (a faster start-up)")
    args = p.parse_args(argv)

    from nanoplug import LLM

    if args.model is None:
        from nanoplug.checkpoint.default_model import default_model_path

        args.model = str(default_model_path(progress=True))
    elif args.model == "random-0.6b":
        from nanoplug.bench.throughput import write_checkpoint

        args.model = str(write_checkpoint())
    parts = set(args.parts.split(","))
    schemas = load_schemas()
    print(f"# {len(schemas)} schemas, model {args.model}, device {args.device}")
    for backend in args.backends.split(","):
        options = {"cpu": {"graphs": False}} if args.no_graphs else {}
        if args.dtype:
            options["dtype"] = args.dtype
        llm = LLM(args.model, device=args.device, structured_output=backend, max_model_len=2048, max_num_seqs=64,
                  **options)
        print(f"\n## {backend}")
        accepted, refused, seconds = compile_all(llm, schemas) if parts & {"compile", "generate", "mask"} \
            else ([], {}, [])
        if "compile" in parts:
            print(f"compile: {len(accepted)} accepted, {len(refused)} refused; compile median "
                  f"{1000 * statistics.median(seconds):.1f} ms, p99 {1000 * pct(seconds, 0.99):.1f} ms")
            for why, count in Counter(r.split(": ", 1)[-1][:120] for r in refused.values()).most_common(8):
                print(f"  refused x{count}: {why}")
        tokens = {}
        if parts & {"generate", "mask"}:
            names = accepted[::max(1, len(accepted) // args.sample)] if args.sample else accepted
            tokens, counts, problems = generate_all(llm, schemas, names, args.max_tokens)
            print(f"generate ({len(names)} schemas, max {args.max_tokens} tokens): {dict(counts)}")
            for line in problems[:10]:
                print("  " + line)
        if "mask" in parts and tokens:
            costs = mask_costs(llm, schemas, tokens)
            print(f"mask per token (host, fill + accept, {len(costs)} tokens): median {1e6 * statistics.median(costs):.1f}"
                  f" us, p99 {1e6 * pct(costs, 0.99):.1f} us")
        if "e2e" in parts:
            schema = dict(schemas)[E2E_SCHEMA]
            print(f"first request of a new schema ({E2E_SCHEMA}): {first_request(llm, schema)}")
            for batch in map(int, args.batches.split(",")):
                r = e2e(llm, schema, batch, args.e2e_tokens, args.repeats)
                print(f"e2e batch {batch}: {r['none']:.3f} ms/token free ({r['none_tokens']} tokens), "
                      f"{r['schema']:.3f} ms/token with the schema ({r['schema_tokens']} tokens): "
                      f"{100 * (r['schema'] / r['none'] - 1):+.1f}%  runs none "
                      f"{[round(x, 3) for x in r['none_runs']]} schema {[round(x, 3) for x in r['schema_runs']]}")
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
