"""`nanoplug compare`: the same prefill and decode inputs through several attention backends (or KV
stores), each against the `manual` oracle: max abs and relative logits difference, time, peak memory.

The steps are fed straight to the model runner with fixed block tables and teacher-forced tokens, so
every backend sees exactly the same inputs (a sampled token that differs cannot change what follows).
The scenario covers plain prefill, decode, prefix-cache hits mixed with fresh prompts, chunked
prefill and a final mixed-length decode.

By default every attention backend that can serve the device runs (on a CPU: cpu, sdpa, manual) on the
embedded default model, and the verdict compares each one's relative logits difference with the tolerance
of the run's compute dtype and weight format (`TOLERANCES`); the exit code is 1 when one exceeds it.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


REFERENCE = "manual"
# The relative logits difference ||a - b|| / ||b|| a backend may show against the oracle on the same inputs:
# float32 attention differs in summation order only (~1e-6 through a small model's layers); quantized
# weights with quantized activations can turn such a difference into a flipped rounding; float16 and
# bfloat16 round every intermediate to 11 and 8 bits.
TOLERANCES = {("float32", False): 1e-4, ("float32", True): 1e-3, ("float16", False): 1e-2, ("float16", True): 1e-2,
              ("bfloat16", False): 5e-2, ("bfloat16", True): 5e-2}


@dataclass
class Step:
    case: str
    is_prefill: bool
    seqs: list[int]  # which sequences take part
    query_lens: list[int]


@dataclass
class Outcome:
    """One backend's result: logits per case, or why it could not run."""

    name: str
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    peak_bytes: int | None = None
    error: str | None = None
    dtype: str = ""
    weights: str = ""  # the weight format's name: "dense", "gguf", ...


def scenario(block_size: int) -> tuple[list[int], list[Step]]:
    """Prompt lengths of six sequences and the steps that run them (the order builds the cache)."""
    bs = block_size
    prompt_lens = [2 * bs + 3, max(bs - 5, 2), 7, 2 * bs + 5, 9, 2 * bs + 10]
    steps = [
        Step("prefill", True, [0, 1, 2], [prompt_lens[0], prompt_lens[1], 7]),
        Step("decode", False, [0, 1, 2], [1, 1, 1]),
        Step("decode", False, [0, 1, 2], [1, 1, 1]),
        Step("prefix-hit", True, [3, 4], [5, 9]),  # seq 3 reuses seq 0's first two blocks
        Step("chunked", True, [5], [bs + 3]),
        Step("chunked", True, [5], [bs + 7]),
        Step("decode-mixed", False, [0, 1, 2, 3, 4, 5], [1] * 6),
    ]
    return prompt_lens, steps


class ScenarioState:
    """Token ids, positions and block tables of the scenario's sequences (same for every backend)."""

    def __init__(self, block_size: int, vocab: int, seed: int = 0):
        import torch

        self.bs = block_size
        gen = torch.Generator().manual_seed(seed)
        self.prompt_lens, self.steps = scenario(block_size)
        self.tokens = [torch.randint(0, vocab, (n + 8,), generator=gen).tolist() for n in self.prompt_lens]
        self.tokens[3][: 2 * block_size] = self.tokens[0][: 2 * block_size]  # a shared prefix
        self.next_block = 0
        self.new_blocks: list[int] = []  # first used in the coming step: the runner clears them (NaN garbage)
        self.tables: list[list[int]] = [[] for _ in self.prompt_lens]
        self.starts = [0] * len(self.prompt_lens)
        self.starts[3] = 2 * block_size

    def _grow(self, i: int, length: int) -> None:
        if i == 3 and not self.tables[3]:
            self.tables[3] = list(self.tables[0][:2])  # the prefix hit: seq 0's first two blocks, reused
        while len(self.tables[i]) * self.bs < length:
            self.tables[i].append(self.next_block)
            self.new_blocks.append(self.next_block)
            self.next_block += 1

    def batch(self, step: Step):
        from nanoplug.api import SamplingBatch, StepBatch

        ids, starts, tables = [], [], []
        for i, n in zip(step.seqs, step.query_lens):
            start = self.starts[i]
            self._grow(i, start + n)
            ids += self.tokens[i][start:start + n]
            starts.append(start)
            tables.append(list(self.tables[i]))
            self.starts[i] = start + n
        rows = list(range(len(step.seqs)))
        sampling = SamplingBatch.greedy(len(rows))
        new, self.new_blocks = self.new_blocks, []
        return StepBatch(step.is_prefill, ids, starts, list(step.query_lens), tables, rows, sampling, rows,
                         new_blocks=new)


def blocks_needed(block_size: int) -> int:
    prompt_lens, _ = scenario(block_size)
    return sum((n + 8 + block_size - 1) // block_size for n in prompt_lens) + 2


def run_backend(model: str, name: str, kind: str = "attention", device: str = "auto", dtype: str = "auto",
                block_size: int | None = None, **options: Any) -> Outcome:
    """Run the whole scenario through one backend; a backend that cannot serve returns its reasons."""
    import torch

    from nanoplug import LLM
    from nanoplug.errors import NanoplugError, UnknownPluginError

    outcome = Outcome(name)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    bs = block_size or (256 if dev.type == "cuda" else 16)
    settings = dict(device=str(dev), dtype=dtype, kv_block_size=bs, num_kv_blocks=blocks_needed(bs),
                    max_num_seqs=8, max_model_len=max(4 * bs, 64), enable_prefix_caching=False)
    settings.update(options)
    settings[kind] = name
    try:
        llm = LLM(model, **settings)
    except UnknownPluginError:
        raise  # a misspelt name is the user's to fix (exit 2), not a backend that cannot serve
    except NanoplugError as exc:
        outcome.error = str(exc)
        return outcome
    outcome.dtype = str(llm.dtype).removeprefix("torch.")
    outcome.weights = llm.choices["weight_format"].name
    from nanoplug.api.step import kv_groups  # (here: the CLI imports no torch before its arguments are checked)

    facts = llm.engine.facts
    if kv_groups(facts.sliding_windows, facts.num_layers).hybrid:
        llm.close()
        outcome.error = ("the scenario drives one block table per sequence, and this model's layers mix sliding "
                         "windows and full attention (a table per KV group); compare it through generate")
        return outcome
    try:
        worker = llm.engine.worker  # the typed worker protocol: a local runner or a proxy over ranks
        state = ScenarioState(bs, llm.engine.facts.vocab_size)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        for step in state.steps:
            batch = state.batch(step)
            t0 = time.perf_counter()
            rows = worker.run(batch).logits
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            outcome.seconds[step.case] = outcome.seconds.get(step.case, 0.0) + time.perf_counter() - t0
            outcome.logits.setdefault(step.case, []).extend(rows)
        if dev.type == "cuda":
            outcome.peak_bytes = torch.cuda.max_memory_allocated(dev) - base
    finally:
        llm.close()
    return outcome


def differences(outcome: Outcome, reference: Outcome) -> dict[str, tuple[float, float]]:
    """Per case: (max abs difference, relative difference ||a - b|| / ||b||) of the logits."""
    import torch

    result = {}
    for case, ref_rows in reference.logits.items():
        a = torch.stack(outcome.logits[case]).double()
        b = torch.stack(ref_rows).double()
        result[case] = ((a - b).abs().max().item(), ((a - b).norm() / b.norm()).item())
    return result


def default_model() -> str:
    """The embedded default model (what `nanoplug generate` runs), installed on first use."""
    from nanoplug.checkpoint.default_model import default_model_path

    return str(default_model_path(progress=True))


def serving_backends(model: str, device: str, dtype: str, kind: str = "attention") -> tuple[list[str], dict[str, list[str]]]:
    """The plugins of `kind` that can serve `model` on `device` in `dtype` (by priority), and why each other cannot."""
    from nanoplug.cli.plugins import build_target
    from nanoplug.engine.registry import Registry

    registry = Registry()
    target = build_target(model, device, dtype, registry)
    names, skipped = [], {}
    for name in registry.by_priority(kind):
        reasons = [str(r) for r in registry.reasons(kind, name, target)]
        if reasons:
            skipped[name] = reasons
        else:
            names.append(name)
    return names, skipped


def tolerance(outcome: Outcome) -> float:
    """The largest relative logits difference allowed for the run's dtype and weight format."""
    return TOLERANCES.get((outcome.dtype, outcome.weights != "dense"), 5e-2)


def verdict(outcomes: list[Outcome], reference: Outcome) -> tuple[bool, str]:
    """(every backend that ran is within the tolerance, the verdict line)."""
    tol = tolerance(reference)
    over = [f"{o.name} {case} {rel:.2e}" for o in outcomes if not o.error
            for case, (_, rel) in differences(o, reference).items() if not rel <= tol]
    failed = [o.name for o in outcomes if o.error]
    basis = (f"relative logits difference against {reference.name!r} at most {tol:.0e}, the tolerance for "
             f"{reference.dtype} compute with {reference.weights} weights")
    if over:
        return False, f"verdict: DIFFERENT: {', '.join(over)} over the {basis}"
    ran = [o.name for o in outcomes if not o.error]
    note = f" ({', '.join(failed)} could not run)" if failed else ""
    return True, f"verdict: AGREE: {', '.join(ran)} within the {basis}{note}"


def table(outcomes: list[Outcome], reference: Outcome) -> str:
    lines = [f"{'backend':10s} {'case':13s} {'max abs diff':>13s} {'rel diff':>10s} {'time ms':>9s} {'peak MiB':>9s}"]
    for o in outcomes:
        if o.error:
            lines.append(f"{o.name:10s} cannot serve: {o.error}")
            continue
        diffs = differences(o, reference)
        peak = f"{o.peak_bytes / 2**20:9.1f}" if o.peak_bytes is not None else f"{'-':>9s}"
        for case, (abs_d, rel_d) in diffs.items():
            lines.append(f"{o.name:10s} {case:13s} {abs_d:13.3e} {rel_d:10.3e} {o.seconds[case] * 1e3:9.2f} {peak}")
            peak = f"{'':9s}"
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="A/B attention backends (or KV stores) against the manual oracle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", default=None,
                   help="comma-separated attention backends (default: every one that can serve the device)")
    p.add_argument("--kv-cache", default=None, help="comma-separated KV stores to compare instead (vs 'torch')")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--kv-block-size", type=int, default=None, help="default: 256 on CUDA, 16 on CPU")
    p.set_defaults(func=run)


def run(args) -> int:
    model = args.model or default_model()
    if args.kv_cache:
        kind, names, ref_name, fixed = "kv_cache", args.kv_cache.split(","), "torch", {"attention": REFERENCE}
    elif args.attention:
        kind, names, ref_name, fixed = "attention", args.attention.split(","), REFERENCE, {}
    else:
        kind, ref_name, fixed = "attention", REFERENCE, {}
        names, skipped = serving_backends(model, args.device, args.dtype)
        for name, reasons in skipped.items():
            print(f"{name}: cannot serve here: {'; '.join(reasons)}")
    names = [n.strip() for n in names if n.strip()]
    reference = run_backend(model, ref_name, kind, args.device, args.dtype, args.kv_block_size, **fixed)
    if reference.error:
        print(f"the reference {kind} {ref_name!r} cannot run: {reference.error}")
        return 1
    outcomes = [reference if n == ref_name else run_backend(model, n, kind, args.device, args.dtype,
                                                            args.kv_block_size, **fixed) for n in names]
    print(f"{kind} backends against {ref_name!r} on {model} (device {args.device}, dtype {args.dtype})")
    print(table(outcomes, reference))
    agree, line = verdict(outcomes, reference)
    print(line)
    return 0 if agree else 1
