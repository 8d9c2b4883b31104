"""Pre-quantized checkpoints on one GPU (issue 35, item 5): batch-1 decode and the bench workload of the random
Qwen3-8B shape in bf16, int4 W4A16 (compressed-tensors pack-quantized, groups of 128: the Triton W4A16 GEMV and
GEMM) and fp8 block-scaled (quant_method "fp8", [128, 128] blocks), the files written by benchmarks/quantize.py.

    python3 benchmarks/gpu_quant.py                        # files, decode and bench of all three (about 15 minutes)
    python3 benchmarks/gpu_quant.py decode --layers 8      # a shorter model, decode only
    python3 benchmarks/gpu_quant.py --tiny --device cpu    # a smoke test of the script here

Each engine runs in a child process of its own (a whole GPU), CUDA graphs on: decode ms/token = (time of 257
tokens - time of 1 token) / 256 after a 128-token prompt, the median of 3 runs; bench = nanoplug.bench's
workload (256 requests, random lengths up to 1024 in and out). Logs to $OUT/gpu_quant.log, JSON to
$OUT/gpu_quant.json, the table printed last. Targets (issue 35): int4 decode >= 2.5x bf16's and bench >= bf16's;
fp8 bench >= 1.3x bf16's and decode >= 1.7x.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gpu_gguf  # noqa: E402
import quantize  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
SCHEMES = {"bf16": None, "int4": "w4a16", "fp8": "fp8_block"}
PROMPT_LEN, NEW_TOKENS, RUNS = 128, 256, 3


def log(line: str) -> None:
    print(line, flush=True)
    with open(OUT / "gpu_quant.log", "a") as f:
        f.write(line + "\n")


def engine_child(path: str, stage: str, result: str, device: str, bench_seqs: str) -> None:
    """In a child process: one engine's decode or bench figures, as JSON to `result`."""
    import torch

    from nanoplug import LLM, SamplingParams
    from nanoplug.bench.throughput import run_bench

    kwargs = dict(device=device)
    kwargs.update(dtype="bfloat16") if device == "cuda" else kwargs.update(dtype="float32", cpu={"kv_cache_gb": 0.2})
    if stage == "bench":
        r = run_bench(path, num_seqs=int(bench_seqs), **kwargs)
        figures = dict(tok_per_s=r.output_tok_per_s, seconds=r.seconds, engine=r.engine)
    else:
        t = time.perf_counter()
        llm = LLM(path, max_model_len=1024, max_num_seqs=1, enable_prefix_caching=False, **kwargs)
        load_s = time.perf_counter() - t
        model = llm.engine.worker.model
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        prompt = [int(i) for i in torch.randint(1000, 100000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))]
        new = NEW_TOKENS if device == "cuda" else 16

        def timed(n: int) -> float:
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - start

        timed(8)
        ones = [timed(1) for _ in range(RUNS)]
        full = [timed(new + 1) for _ in range(RUNS)]
        figures = dict(decode_ms=(statistics.median(full) - statistics.median(ones)) / new * 1000,
                       prefill_ms=statistics.median(ones) * 1000, load_s=load_s, weights_gb=weights / 1e9,
                       weight_format=llm.choices["weight_format"].name)
        llm.close()
    Path(result).write_text(json.dumps(figures))


def run_child(path: Path, name: str, stage: str, device: str, bench_seqs: int) -> dict:
    result = gpu_gguf.WORK / f"quant-{name}-{stage}.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, __file__, "_engine", str(path), stage, str(result), device, str(bench_seqs)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    with open(OUT / "gpu_quant.log", "a") as f:
        f.write(f"=== {' '.join(cmd)} (rc={proc.returncode}, {time.perf_counter() - t:.0f} s)\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"the {name} {stage} engine failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
    figures = json.loads(result.read_text())
    log(f"{name} {stage}: {figures}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", nargs="?", default="all", choices=["all", "files", "decode", "bench", "_engine"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--layers", type=int, default=gpu_gguf.SHAPE["num_hidden_layers"])
    parser.add_argument("--weights", default=",".join(SCHEMES), help="which of bf16,int4,fp8")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bench-seqs", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same vocabulary (smoke test)")
    args = parser.parse_args()
    if args.stage == "_engine":
        engine_child(*args.rest)
        return 0
    if args.tiny:
        quantize.tiny(args)
    OUT.mkdir(parents=True, exist_ok=True)
    gpu_gguf.WORK.mkdir(parents=True, exist_ok=True)
    names = args.weights.split(",")
    folders = gpu_gguf.guarded("files", quantize.quantized_folders, args.layers,
                               [SCHEMES[n] for n in names if SCHEMES[n]]) or {}
    summary: dict = {}
    if args.stage != "files":
        for name in names:
            folder = folders.get(SCHEMES[name] or "bf16")
            for stage in ("decode", "bench"):
                if folder is not None and args.stage in ("all", stage):
                    summary.setdefault(name, {})[stage] = gpu_gguf.guarded(
                        f"{name} {stage}", run_child, folder, name, stage, args.device, args.bench_seqs)
    (OUT / "gpu_quant.json").write_text(json.dumps(summary, indent=1, default=str))
    base = summary.get("bf16", {})
    log("\n| weights | decode ms/token | vs bf16 | bench tok/s | vs bf16 | weights GB |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, fig in summary.items():
        d, b = fig.get("decode") or {}, fig.get("bench") or {}
        dr = f"{base['decode']['decode_ms'] / d['decode_ms']:.2f}x" if d and (base.get("decode") or {}) else ""
        br = f"{b['tok_per_s'] / base['bench']['tok_per_s']:.2f}x" if b and (base.get("bench") or {}) else ""
        log(f"| {name} | {d.get('decode_ms', float('nan')):.2f} | {dr} | {b.get('tok_per_s', float('nan')):.0f} | {br} "
            f"| {d.get('weights_gb', float('nan')):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
