"""Issue 34's MoE benchmark on one H200: a random bf16 checkpoint of the Qwen3-30B-A3B shape with 24 of its 48
layers (hidden 2048, 32 q / 4 KV heads, head_dim 128, 128 experts of intermediate 768, 8 a token, vocab 151936,
untied: about 30 GB), then

(a) the fused MoE kernel alone (nanoplug/kernels/moe/fused_moe.py, both projections and the SiLU-and-mul, the
    routing sort included) at batch 1, 64 and 256: time per call, TFLOP/s (2 * tokens * k * 3 * H * I flops) and
    TB/s (the bytes of the experts the batch touches, plus activations);
(b) `nanoplug bench` (the throughput workload) and `nanoplug bench --latency` on the checkpoint.

`--fp8` runs both with the experts in e4m3 and one scale per row (`--quantization fp8`: every linear layer, the
experts read as e4m3 by the same kernels): half the bytes of a decode step's experts.

`--tune` first sweeps the kernel's block sizes per batch size and writes the table the kernel reads
(nanoplug/kernels/moe/configs/E=128,N=768,device_name=<GPU>.json); commit it. `--sweep-gemv` times the few-token
GEMV path (`experts_gemv`) over a grid of its block sizes against the grouped GEMM at 1-8 tokens, each call in a
CUDA graph over 4 layers' weights in turn (as a step reads them: from HBM, not L2). `--tiny` runs everything on the CPU
with a tiny shape (the batched-matmul path stands in for the kernel), which the tests do.

usage: python benchmarks/gpu_moe.py [--tiny] [--tune] [--skip a,b] [--folder DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            tie_word_embeddings=False, max_position_embeddings=2048)
BATCHES = (1, 64, 256)
TUNE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def stage(name, fn, failures):
    print(f"\n## {name}", flush=True)
    t = time.perf_counter()
    try:
        fn()
    except Exception:  # noqa: BLE001  (print it, run the other stages)
        traceback.print_exc()
        failures.append(name)
    print(f"({time.perf_counter() - t:.0f} s)", flush=True)


def _inputs(m, e, k, h, i, dtype, device, seed=0):
    from nanoplug.api.layers import route

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, h, generator=g, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device=device) * 0.02).to(dtype)
    weights, ids = route(torch.randn(m, e, generator=g, device=device), k, True)
    return x, w13, w2, weights, ids


def _time_ms(fn, device) -> float:
    if device.type == "cuda":
        sys.path.insert(0, str(Path(__file__).parent))
        from _cuda_timing import cuda_ms

        return cuda_ms(fn, iters=50, warmup=5)
    fn()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t) / 3 * 1e3


def kernel_figures(shape, device, dtype, out: dict, fp8: bool = False) -> None:
    from nanoplug.api.layers import experts_batched, experts_plain
    from nanoplug.kernels.moe import fused_moe

    e, k, h, i = shape["num_experts"], shape["num_experts_per_tok"], shape["hidden_size"], shape["moe_intermediate_size"]
    run = fused_moe.fused_experts if device.type == "cuda" else experts_batched
    print(f"| batch | path | ms | TFLOP/s | TB/s | experts touched | max rel. error vs plain |\n|---|---|---|---|---|---|---|")
    for m in BATCHES:
        x, w13, w2, weights, ids = _inputs(m, e, k, h, i, dtype, device)
        scales = None
        if fp8:
            from nanoplug.plugins.weight_formats.fp8 import quantize_rows

            (w13, s13), (w2, s2) = quantize_rows(w13), quantize_rows(w2)
            scales = (s13, s2)
        want = experts_plain(x.float(), w13 if fp8 else w13.float(), w2 if fp8 else w2.float(), weights, ids,
                             scales=scales)
        err = float((run(x, w13, w2, weights, ids, scales=scales).float() - want).abs().max() / want.abs().max())
        ms = _time_ms(lambda: run(x, w13, w2, weights, ids, scales=scales), device)
        touched = int(torch.unique(ids).numel())
        flops = 2 * m * k * 3 * h * i
        nbytes = touched * 3 * h * i * w13.element_size() + m * h * x.element_size() * 2 + m * k * (3 * i + h) * 2
        row = dict(ms=ms, tflops=flops / ms / 1e9, tbs=nbytes / ms / 1e9, experts=touched, error=err)
        out[m] = row
        print(f"| {m} | {run.__name__}{' fp8' if fp8 else ''} | {ms:.4f} | {row['tflops']:.2f} | {row['tbs']:.3f} | {touched} | {err:.1e} |",
              flush=True)


def sweep_gemv(shape, device, dtype, fp8: bool = False) -> None:
    """Per batch of 1-8 tokens: the grouped GEMM (its tuned config) and each GEMV config, graph-timed; with `fp8`
    the experts in e4m3 with per-row scales (one byte a weight: the K step that fills a load differs)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _cuda_timing import graph_us
    from nanoplug.api.layers import experts_plain
    from nanoplug.kernels.moe import fused_moe

    e, k, h, i = shape["num_experts"], shape["num_experts_per_tok"], shape["hidden_size"], shape["moe_intermediate_size"]
    layers = []
    for s in range(4):  # (w13, w2, scales) of 4 layers
        _, w13, w2, _, _ = _inputs(1, e, k, h, i, dtype, device, seed=s)
        if fp8:
            from nanoplug.plugins.weight_formats.fp8 import quantize_rows

            (w13, s13), (w2, s2) = quantize_rows(w13), quantize_rows(w2)
            layers.append((w13, w2, (s13, s2)))
        else:
            layers.append((w13, w2, None))
    width = 1 if fp8 else 2
    ks = (128, 256, 512) if fp8 else (128, 256)
    grid = [dict(UP_BLOCK_N=un, UP_BLOCK_K=uk, DOWN_BLOCK_N=dn, DOWN_BLOCK_K=dk, num_warps=w)
            for un, uk, dn, dk, w in itertools.product((8, 16), ks, (4, 8), ks, (4, 8))]
    print(f"| tokens | path{' (fp8)' if fp8 else ''} | us a layer | TB/s of the experts read |\n|---|---|---|---|")
    for m in (1, 2, 4, 8):
        x, _, _, weights, ids = _inputs(m, e, k, h, i, dtype, device, seed=9)
        pairs_bytes = m * k * 3 * h * i * width  # the GEMV reads each pair's expert (the GEMM each touched one once)
        touched = int(torch.unique(ids).numel()) * 3 * h * i * width

        def timed(fn):
            return graph_us(lambda: [fn(*lay) for lay in layers], calls=5) / 4

        grouped = timed(lambda w13, w2, sc: fused_moe.fused_experts(x, w13, w2, weights, ids, scales=sc,
                                                                    config=fused_moe.config_for(m, e, i, device)))
        print(f"| {m} | grouped GEMM | {grouped:.1f} | {touched / grouped / 1e6:.2f} |", flush=True)
        best = None
        for cfg in grid:
            try:
                us = timed(lambda w13, w2, sc: fused_moe.experts_gemv(x, w13, w2, weights, ids, config=cfg, scales=sc))
            except Exception as exc:  # noqa: BLE001  (out of registers, say: skip it)
                print(f"  skip {cfg}: {type(exc).__name__}")
                continue
            if best is None or us < best[0]:
                best = (us, cfg)
        w13, w2, sc = layers[0]
        want = experts_plain(x.float(), w13 if fp8 else w13.float(), w2 if fp8 else w2.float(), weights, ids,
                             scales=sc)
        got = fused_moe.experts_gemv(x, w13, w2, weights, ids, config=best[1], scales=sc).float()
        err = float((got - want).abs().max() / want.abs().max())
        print(f"| {m} | GEMV {best[1]} | {best[0]:.1f} | {pairs_bytes / best[0] / 1e6:.2f} | (error {err:.1e})",
              flush=True)
        default = timed(lambda w13, w2, sc: fused_moe.experts_gemv(x, w13, w2, weights, ids, scales=sc))
        print(f"| {m} | GEMV, the default config | {default:.1f} | {pairs_bytes / default / 1e6:.2f} |", flush=True)


def tune(shape, device, dtype) -> Path:
    """Each batch size's fastest block sizes over a grid (checked against the plain path), written as the table."""
    from nanoplug.kernels.moe import fused_moe

    e, k, h, i = shape["num_experts"], shape["num_experts_per_tok"], shape["hidden_size"], shape["moe_intermediate_size"]
    grid = [dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g, num_warps=w, num_stages=s)
            for bm, bn, bk, g, w, s in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (1, 16), (4, 8),
                                                         (3, 4))]
    table = {}
    for m in TUNE_BATCHES:
        x, w13, w2, weights, ids = _inputs(m, e, k, h, i, dtype, device)
        best = None
        for cfg in grid:
            if cfg["BLOCK_SIZE_M"] > max(16, 4 * m * k // 1):  # rows far past the pairs: only padding
                continue
            try:
                ms = _time_ms(lambda: fused_moe.fused_experts(x, w13, w2, weights, ids, config=cfg), device)
            except Exception as exc:  # noqa: BLE001  (out of shared memory, say: skip it)
                print(f"  skip {cfg}: {type(exc).__name__}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        table[str(m)] = best[1]
        print(f"batch {m}: {best[0]:.4f} ms {best[1]}", flush=True)
    name = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    file = fused_moe.CONFIG_DIR / f"E={e},N={i},device_name={name}.json"
    file.write_text(json.dumps(table, indent=1) + "\n")
    fused_moe._configs.cache_clear()
    print(f"wrote {file}")
    return file


def bench(folder: Path, tiny: bool, out: dict, fp8: bool = False) -> None:
    engine = ["--device", "cpu", "--dtype", "float32", "--kv-block-size", "16", "--max-model-len", "256"] if tiny \
        else []
    engine += ["--quantization", "fp8"] if fp8 else []
    runs = {
        "throughput": ["--num-seqs", "4", "--max-input-len", "100", "--max-output-len", "100"] if tiny else [],
        "latency": ["--latency", *(["--latency-prompts", "2", "--ttft-prompt-len", "40", "--decode-prompt-len", "20",
                                    "--decode-tokens", "5", "--prefill-prompts", "3", "--prefill-prompt-len", "48"]
                                   if tiny else ["--decode-prompt-len", "512"])],
    }
    for name, flags in runs.items():
        cmd = [sys.executable, "-c", "import sys; from nanoplug.cli import main; sys.exit(main(sys.argv[1:]))",
               "bench", "--model", str(folder), *flags, *engine]
        print("$ nanoplug", " ".join(cmd[3:]), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-4000:], proc.stderr[-4000:] if proc.returncode else "", flush=True)
        out[name] = proc.stdout
        if proc.returncode:
            raise RuntimeError(f"nanoplug bench ({name}) exited with {proc.returncode}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (what the tests run)")
    p.add_argument("--tune", action="store_true", help="sweep the kernel's block sizes first and write the table")
    p.add_argument("--sweep-gemv", action="store_true", help="time the few-token GEMV path's block sizes first")
    p.add_argument("--skip", default="", help="stages to skip: a (kernel), b (bench)")
    p.add_argument("--folder", default=None, help="where the checkpoint is (written there first if missing)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--fp8", action="store_true", help="the experts (and every linear layer) in fp8, per-row scales")
    args = p.parse_args(argv)
    from nanoplug.bench.checkpoints import QWEN3_30B_A3B_SHAPE, write_large_random_checkpoint

    shape = TINY if args.tiny else QWEN3_30B_A3B_SHAPE
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    folder = Path(args.folder or ("/tmp/nanoplug-moe-tiny" if args.tiny else "/tmp/nanoplug-qwen3-30b-a3b-24l"))
    failures, figures = [], {"kernel": {}, "bench": {}}
    skip = set(filter(None, args.skip.split(",")))
    if args.tune:
        stage("tune the kernel's block sizes", lambda: tune(shape, device, dtype), failures)
    if args.sweep_gemv:
        stage("the few-token GEMV path's block sizes", lambda: sweep_gemv(shape, device, dtype, args.fp8), failures)
    if "a" not in skip:
        stage("(a) fused MoE kernel", lambda: kernel_figures(shape, device, dtype, figures["kernel"], args.fp8),
              failures)
    if "b" not in skip:
        def _bench():
            t = time.perf_counter()
            write_large_random_checkpoint(folder, "Qwen3MoeForCausalLM", dtype=torch.bfloat16,
                                          device=device.type, **shape)
            print(f"checkpoint {folder} ({time.perf_counter() - t:.0f} s)", flush=True)
            bench(folder, args.tiny, figures["bench"], args.fp8)
        stage("(b) nanoplug bench", _bench, failures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print("\nFAILED: " + ", ".join(failures) if failures else "\nall stages ran")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
