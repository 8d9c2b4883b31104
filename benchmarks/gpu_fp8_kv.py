"""The fp8 KV cache against the bf16 cache on one GPU, in one process, each stage on its own (a failure
prints its error and the other stages still run); a markdown table last.

(a) `nanoplug bench`'s workload (nanoplug/bench/throughput.py, exactly) with `attention="flash"`, `kv_cache="triton"`
    (bf16) then `kv_cache="fp8"`: output tok/s of each and the ratio (target: fp8 >= 1.15x).
(b) perplexity of the default model (SmolLM2-135M, real weights, bf16 on CUDA) on
    benchmarks/data/apache-2.0.txt through each cache (target: fp8 within 1%). The text is prefilled in
    chunks of CHUNK tokens, so every chunk after the first attends to keys read back from the cache
    (through dequantized pages), as decode reads them; a one-shot prefill would never read the cache.
(c) KV tokens each cache holds in the same memory (the engines of (a)).
(d) decode attention alone, batch 256 of 1-2k-token contexts in the bench model's shape: our Triton
    kernel over fp8 (a few launch settings) and over bf16, and FlashAttention-4's bf16 paged decode as
    the `flash` backend calls it; time per call and the K/V bytes read per second.

usage: python benchmarks/gpu_fp8_kv.py [--skip a,b,c,d]
"""
from __future__ import annotations

import argparse
import math
import time
import traceback
from pathlib import Path

import torch

from _cuda_timing import cuda_ms

CHUNK = 64
TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"
rows: list[tuple[str, str, str]] = []  # (measure, bf16 cache, fp8 cache)


def stage(name, fn):
    print(f"\n## {name}", flush=True)
    t = time.perf_counter()
    try:
        fn()
    except Exception:  # noqa: BLE001  (any failure: print it, run the other stages)
        traceback.print_exc()
        rows.append((name, "FAILED", "FAILED"))
    print(f"({time.perf_counter() - t:.0f} s)", flush=True)


def bench_throughput():
    from nanoplug import LLM, SamplingParams
    from nanoplug.bench.throughput import workload, write_checkpoint

    model = str(write_checkpoint())
    result = {}
    for kv in ("triton", "fp8"):
        llm = LLM(model, attention="flash", kv_cache=kv, max_model_len=4096)
        try:
            llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # untimed warm-up, as the bench
            prompts, params = workload()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t
            tokens = sum(len(o.token_ids) for o in outs)
            blocks = llm.engine.num_kv_blocks
            result[kv] = (tokens / seconds, blocks * llm.config.kv_block_size, blocks)
            print(f"kv_cache={kv}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} output tok/s; "
                  f"{blocks} KV blocks = {result[kv][1]:,} tokens; plugins {llm.describe_plugins()}", flush=True)
        finally:
            llm.close()
    (bf, bf_tokens, _), (f8, f8_tokens, _) = result["triton"], result["fp8"]
    print(f"fp8 / bf16 throughput: {f8 / bf:.3f}x (target >= 1.15x); KV tokens {f8_tokens / bf_tokens:.2f}x")
    rows.append(("bench output tok/s", f"{bf:,.0f}", f"{f8:,.0f} ({f8 / bf:.3f}x)"))
    rows.append(("KV tokens in the same memory", f"{bf_tokens:,}", f"{f8_tokens:,} ({f8_tokens / bf_tokens:.2f}x)"))


def perplexity():
    from nanoplug import LLM, SamplingParams
    from nanoplug.checkpoint.default_model import default_model_path

    model = str(default_model_path(progress=False, float32=True))
    text = TEXT.read_text()
    ppl = {}
    for kv in ("torch", "fp8"):  # SmolLM2's K/V rows (3 x 64) are no power of two: the plain store
        llm = LLM(model, attention="flash", kv_cache=kv, dtype="bfloat16", device="cuda", max_model_len=4096,
                  max_num_batched_tokens=CHUNK, max_num_seqs=1, cuda={"enforce_eager": True})
        try:
            out = llm.generate([text], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            lps = [p.logprob for p in out.prompt_logprobs if p is not None]
            ppl[kv] = math.exp(-sum(lps) / len(lps))
            print(f"kv_cache={kv}: perplexity {ppl[kv]:.4f} over {len(lps)} tokens (chunks of {CHUNK})", flush=True)
        finally:
            llm.close()
    change = ppl["fp8"] / ppl["torch"] - 1
    print(f"fp8 vs bf16 cache perplexity: {100 * change:+.3f}% (target within 1%)")
    rows.append(("SmolLM2-135M perplexity, apache-2.0.txt", f"{ppl['torch']:.4f}",
                 f"{ppl['fp8']:.4f} ({100 * change:+.3f}%)"))


DECODE_SHAPE = dict(batch=256, heads=16, kv_heads=8, dim=128, page=256)


def decode_case(batch, heads, kv_heads, dim, page):
    """One decode step of 1-2k-token contexts on scattered pages: (q, bf16 K/V, their fp8 copies, tables, lens)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lens = torch.randint(1024, 2049, (batch,), dtype=torch.int32)
    width = int(((lens + page - 1) // page).max())
    num_blocks = batch * width
    tables = torch.randperm(num_blocks).view(batch, width).int().to(dev)  # distinct pages, scattered
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)
    k16 = torch.randn(num_blocks, page, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v16 = torch.randn_like(k16)
    return q, k16, v16, k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn), tables, lens.to(dev)


def decode_kernels():
    from nanoplug.kernels.attention import triton_decode as td

    dev = torch.device("cuda")
    batch, kv_heads, dim = DECODE_SHAPE["batch"], DECODE_SHAPE["kv_heads"], DECODE_SHAPE["dim"]
    q, k16, v16, k8, v8, tables, lens = decode_case(**DECODE_SHAPE)
    one = torch.tensor(1.0, device=dev)
    tokens = int(lens.sum())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def timed(fn):
        return cuda_ms(fn, iters=30) * 1e-3

    def report(label, seconds, elem_bytes):
        gbs = 2 * tokens * kv_heads * dim * elem_bytes / seconds / 1e9
        print(f"{label:<52} {seconds * 1e6:8.1f} us  {gbs:7.0f} GB/s", flush=True)
        return seconds, gbs

    default = td.DecodeConfig()
    results = {}
    configs = [default] + [td.DecodeConfig(block_n=n, num_warps=w, num_stages_8bit=s)
                           for n, w, s in ((32, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3))]
    for cfg in configs:
        for splits in sorted({1, td.num_splits(batch, kv_heads, 2048, sms, cfg), 2, 4}):
            label = (f"triton fp8 block_n={cfg.block_n} warps={cfg.num_warps} stages={cfg.num_stages_8bit} "
                     f"splits={splits}")
            try:
                results[label] = report(label, timed(lambda: td.paged_decode(
                    q, k8, v8, tables, lens, dim ** -0.5, splits, one, one, cfg)), 1)
            except Exception as exc:  # noqa: BLE001  (a setting that does not compile: next)
                print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
    splits = td.num_splits(batch, kv_heads, 2048, sms, default)
    fp8_default = results.get(f"triton fp8 block_n={default.block_n} warps={default.num_warps} "
                              f"stages={default.num_stages_8bit} splits={splits}")
    bf16_triton = report("triton bf16 (default settings)", timed(lambda: td.paged_decode(
        q, k16, v16, tables, lens, dim ** -0.5, splits, None, None, default)), 2)
    fa4 = None
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func

        fa4 = report("FlashAttention-4 bf16 (as the flash backend calls it)", timed(lambda: flash_attn_varlen_func(
            q.unsqueeze(1), k16, v16, seqused_k=lens, page_table=tables, softmax_scale=dim ** -0.5, causal=True)), 2)
    except Exception as exc:  # noqa: BLE001
        print(f"FlashAttention-4: {type(exc).__name__}: {exc}")
    best = min(results.items(), key=lambda kv: kv[1][0]) if results else None
    if best:
        print(f"fastest fp8 setting: {best[0]}")
    ref = fa4 or bf16_triton

    def cell(r):
        return f"{r[0] * 1e6:.0f} us, {r[1]:.0f} GB/s" if r else "-"

    rows.append(("decode attention, 256 x 1-2k (bf16: FA4)", cell(ref),
                 cell(fp8_default) + (f" ({ref[0] / fp8_default[0]:.2f}x)" if fp8_default else "")))
    if best:
        rows.append((f"  fastest fp8: {best[0].removeprefix('triton fp8 ')}", "", cell(best[1])))
    rows.append(("  triton kernel over bf16", cell(bf16_triton), ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", default="", help="stages to skip, e.g. a,b")
    skip = set(parser.parse_args().skip.split(","))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if "d" not in skip:
        stage("(d) decode attention kernels", decode_kernels)
    if "b" not in skip:
        stage("(b) perplexity, bf16 vs fp8 cache", perplexity)
    if "a" not in skip:
        stage("(a)+(c) bench throughput and KV tokens", bench_throughput)
    print("\n| measure | bf16 cache | fp8 cache |\n| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
