"""Pre-quantized checkpoints on one GPU (issue 35, item 5): batch-1 decode and the bench workload of the random
Qwen3-8B shape in bf16, int4 W4A16 (compressed-tensors pack-quantized, groups of 128: the Triton W4A16 GEMV and
GEMM) and fp8 block-scaled (quant_method "fp8", [128, 128] blocks: the Triton block-scaled fp8 GEMV and GEMM),
the files drawn directly in their formats by benchmarks/quantize_8b.py.

    python3 benchmarks/gpu_quant.py                        # files, decode and bench of all three (about 5 minutes)
    python3 benchmarks/gpu_quant.py --weights int4 --layers 8
    python3 benchmarks/gpu_quant.py --tiny --device cpu    # a smoke test of the script here

Each engine runs in a child process of its own (a whole GPU), CUDA graphs on, and gives both figures: batch-1
decode = `nanoplug bench --latency`'s measurement (nanoplug/bench/latency.py: one fresh 512-token prompt alone,
256 tokens, ms per token after the first), then the bench workload (nanoplug/bench/throughput.py: 256 requests,
random lengths up to 1024 in and out, output tok/s). Logs to $OUT/gpu_quant.log, JSON to $OUT/gpu_quant.json,
the table printed last. Targets (issue 35): int4 decode >= 2.5x bf16's and bench >= bf16's; fp8 bench >= 1.3x
bf16's and decode >= 1.7x.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import quantize_8b  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
SCHEMES = {"bf16": "bf16", "int4": "w4a16", "fp8": "fp8_block"}
DECODE_PROMPT_LEN, DECODE_TOKENS = 512, 256


def log(line: str) -> None:
    print(line, flush=True)
    with open(OUT / "gpu_quant.log", "a") as f:
        f.write(line + "\n")


def engine_child(path: str, result: str, device: str, bench_seqs: str) -> None:
    """In a child process: one engine's decode and bench figures, as JSON to `result`."""
    from nanoplug.bench import latency, throughput

    options = dict(device=device)
    options.update(dtype="bfloat16") if device == "cuda" else options.update(dtype="float32", cpu={"kv_cache_gb": 0.2})
    llm, startup = throughput.open_engine(path, **options)
    try:
        model = llm.engine.worker.model
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        fresh = latency.FreshPrompts(llm.engine.facts.vocab_size)
        sizes = dict(ttft_prompts=1, ttft_prompt_len=DECODE_PROMPT_LEN, decode_prompt_len=DECODE_PROMPT_LEN,
                     prefill_prompts=1, prefill_prompt_len=64)
        latency.measure(llm, fresh, **sizes, decode_tokens=16)  # warm-up
        tokens = DECODE_TOKENS if device == "cuda" else 8
        lat = latency.measure(llm, fresh, **sizes, decode_tokens=tokens)
        bench = throughput.time_workload(llm, *throughput.workload(int(bench_seqs)), None, startup)
        figures = dict(decode_ms=lat["decode_ms_per_token"], ttft_ms=lat["ttft_ms"][0], tok_per_s=bench.output_tok_per_s,
                       bench_seconds=bench.seconds, startup_s=startup, weights_gb=weights / 1e9,
                       weight_format=llm.choices["weight_format"].name, engine=bench.engine)
    finally:
        llm.close()
    Path(result).write_text(json.dumps(figures))


def run_child(path: Path, name: str, device: str, bench_seqs: int) -> dict:
    result = OUT / f"quant-{name}.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, __file__, "_engine", str(path), str(result), device, str(bench_seqs)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    with open(OUT / "gpu_quant.log", "a") as f:
        f.write(f"=== {' '.join(cmd)} (rc={proc.returncode}, {time.perf_counter() - t:.0f} s)\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"the {name} engine failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
    figures = json.loads(result.read_text())
    log(f"{name}: {figures} ({time.perf_counter() - t:.0f} s)")
    return figures


def guarded(name: str, fn, *args):
    """Run one stage; a failure is logged with its traceback and the run goes on."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001  (a stage's failure must not hide the others' figures)
        log(f"[{name}] FAILED:\n{traceback.format_exc()}")
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", nargs="?", default="all", choices=["all", "files", "_engine"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--weights", default=",".join(SCHEMES), help="which of bf16,int4,fp8")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bench-seqs", type=int, default=256)
    parser.add_argument("--work", type=Path, default=quantize_8b.WORK, help="where the checkpoints are written")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same vocabulary (smoke test)")
    args = parser.parse_args()
    if args.stage == "_engine":
        engine_child(*args.rest)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    names = args.weights.split(",")
    t = time.perf_counter()
    folders = guarded("files", quantize_8b.write_all, args.work, [SCHEMES[n] for n in names], args.layers,
                      args.tiny, args.device) or {}
    log(f"files: {time.perf_counter() - t:.0f} s")
    summary = {}
    if args.stage == "all":
        for name in names:
            if SCHEMES[name] in folders:
                summary[name] = guarded(name, run_child, folders[SCHEMES[name]], name, args.device, args.bench_seqs)
    (OUT / "gpu_quant.json").write_text(json.dumps(summary, indent=1, default=str))
    base = summary.get("bf16") or {}
    log(f"\n| weights | format | decode ms/token ({DECODE_PROMPT_LEN}-token prompt) | vs bf16 | bench tok/s | vs bf16 "
        "| weights GB |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, fig in summary.items():
        if not fig:
            log(f"| {name} | failed | | | | | |")
            continue
        dr = f"{base['decode_ms'] / fig['decode_ms']:.2f}x" if base else ""
        br = f"{fig['tok_per_s'] / base['tok_per_s']:.2f}x" if base else ""
        log(f"| {name} | {fig['weight_format']} | {fig['decode_ms']:.2f} | {dr} | {fig['tok_per_s']:.0f} | {br} "
            f"| {fig['weights_gb']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
