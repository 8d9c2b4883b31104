"""The article's headline ratios on this GPU (Qwen3-0.6B shape, bf16), one table at the end.

1. prefill, FlashAttention vs manual attention: one prefill step of a sequence of 2k, 4k, 8k tokens
   (time of the step, and peak memory above the loaded engine) -- article: 4.1x faster, 37% less memory;
2. the Triton slot-mapping store vs the plain PyTorch store (decode- and prefill-sized writes) --
   article: 2.3x;
3. batch-1 decode latency, 512-token prompt, 256 new tokens: eager vs CUDA graphs vs graphs +
   torch.compile -- article: 28 ms -> 9 ms per token (RTX 3090).

usage: python benchmarks/studies/gpu_ratios.py [prefill|store|decode ...]   (default: all); JSON lines to stdout.
"""
from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch

from nanoplug import LLM, SamplingParams
from nanoplug.bench.throughput import write_checkpoint
from nanoplug.worker.runner import StepBatch
from nanoplug.worker.sampler import SamplingBatch

BLOCK = 256


def emit(**row):
    print(json.dumps(row), flush=True)


def free():
    gc.collect()
    torch.cuda.empty_cache()


def prefill_batch(length: int) -> StepBatch:
    ids = torch.randint(0, 10000, (length,)).tolist()
    blocks = list(range((length + BLOCK - 1) // BLOCK))
    return StepBatch(True, ids, [0], [length], [blocks], [0], SamplingBatch([0.0], [0], [1.0], [0.0], [None], [0]))


def bench_prefill(model: str) -> None:
    for attention in ("flash", "manual"):
        llm = LLM(model, attention=attention, kv_cache="torch", dtype="bfloat16", cuda={"enforce_eager": True},
                  kv_block_size=BLOCK, num_kv_blocks=40, max_model_len=8448, max_num_batched_tokens=8448)
        runner = llm.engine.worker
        for length in (2048, 4096, 8192):
            batch = prefill_batch(length)
            runner.run(batch)  # warm-up (kernel compiles)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(5):
                t = time.perf_counter()
                runner.run(batch)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            emit(test="prefill", attention=attention, tokens=length, ms=statistics.median(times) * 1e3,
                 step_peak_mib=(torch.cuda.max_memory_allocated() - base) / 2**20,
                 total_peak_mib=torch.cuda.max_memory_allocated() / 2**20)
        llm.close()
        del llm, runner
        free()


def bench_store() -> None:
    import triton.testing

    from nanoplug.plugins.kv_cache.torch import TorchStore
    from nanoplug.plugins.kv_cache.triton import TritonStore

    heads, dim, blocks = 8, 128, 2048
    kc = torch.randn(blocks, BLOCK, heads, dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    for n in (256, 16384):
        qkv = torch.randn(n, 32 * dim, device="cuda", dtype=torch.bfloat16)  # k, v as the strided views the model makes
        k, v = qkv[:, 16 * dim:24 * dim].view(n, heads, dim), qkv[:, 24 * dim:].view(n, heads, dim)
        slots = torch.randperm(blocks * BLOCK, device="cuda")[:n]
        for name, store in (("torch", TorchStore()), ("triton", TritonStore())):
            ms = triton.testing.do_bench(lambda: store.store(k, v, kc, vc, slots), warmup=50, rep=300,
                                         return_mode="median")
            emit(test="store", store=name, tokens=n, us=ms * 1e3, gbps=4 * n * heads * dim * 2 / ms / 1e6)


def bench_decode(model: str) -> None:
    prompt = torch.randint(0, 10000, (512,)).tolist()
    configs = (("eager", True, False), ("graphs", False, False), ("graphs+compile", False, True))
    for name, eager, compile_ in configs:
        llm = LLM(model, attention="flash", kv_cache="triton", dtype="bfloat16",
                  cuda={"enforce_eager": eager, "compile_fused_ops": compile_},
                  kv_block_size=BLOCK, num_kv_blocks=8, max_num_seqs=4, max_model_len=1024)
        runs = {}
        for new in (1, 256, 1, 256):
            p = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new)
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate([prompt], p, use_tqdm=False)
            torch.cuda.synchronize()
            runs[new] = time.perf_counter() - t  # the second of each pair counts (the first warms up)
        emit(test="decode", config=name, ms_per_token=(runs[256] - runs[1]) / 255 * 1e3, prefill_ms=runs[1] * 1e3)
        llm.close()
        del llm
        free()


if __name__ == "__main__":
    wanted = sys.argv[1:] or ["prefill", "store", "decode"]
    model = str(write_checkpoint())
    for test in wanted:
        try:
            {"prefill": lambda: bench_prefill(model), "store": bench_store, "decode": lambda: bench_decode(model)}[test]()
        except Exception as exc:  # one failing part must not hide the others' figures
            emit(test=test, error=f"{type(exc).__name__}: {exc}")
