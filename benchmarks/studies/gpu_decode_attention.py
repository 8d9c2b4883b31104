"""FlashAttention-4's paged decode call, in the shapes and settings the `flash` backend could use,
on one batch-256 decode step of the bench workload's shape (Qwen3-0.6B: 16 query / 8 KV heads of 128).

Prints time per call and the KV bytes read per second (the floor is the GPU's copy rate).
usage: python benchmarks/studies/gpu_decode_attention.py [context_len ...]
       python benchmarks/studies/gpu_decode_attention.py --splits BATCHES CONTEXT   (e.g. --splits 1,4,8,16,32,64 1500:
           the batch-q call with num_splits 1 and auto at smaller batches, where one split per (sequence,
           KV head) leaves SMs idle)
"""
from __future__ import annotations

import random
import sys

import torch
from flash_attn.cute.interface import flash_attn_varlen_func

from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _cuda_timing import cuda_ms

torch.manual_seed(0)
random.seed(0)
dev, dt = torch.device("cuda"), torch.bfloat16
B, H, KVH, D = 256, 16, 8, 128


def case(lens: list[int], page: int, batch: int = B):
    pages = [(n + page - 1) // page for n in lens]
    total = sum(pages) + 1
    k = torch.randn(total, page, KVH, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    perm = torch.randperm(total - 1).tolist()
    width = max(pages)
    table = torch.full((batch, width), total - 1, dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = torch.tensor(perm[at:at + p])
        at += p
    return k, v, table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)


def splits_sweep(batches: list[int], mean: int) -> None:
    print(f"{'batch':>6} {'ctx':>6} {'splits=1 ms':>12} {'auto ms':>9} {'TB/s (1)':>9} {'TB/s (auto)':>11} maxdiff")
    for b in batches:
        lens = [max(1, int(random.uniform(0.8, 1.2) * mean)) for _ in range(b)]
        gbytes = sum(lens) * KVH * D * 2 * 2 / 1e9
        k, v, table, used = case(lens, 256, b)
        qb = torch.randn(b, 1, H, D, device=dev, dtype=dt)
        one = lambda: flash_attn_varlen_func(qb, k, v, seqused_k=used, page_table=table, causal=True)  # noqa: E731
        auto = lambda: flash_attn_varlen_func(qb, k, v, seqused_k=used, page_table=table, causal=True,  # noqa: E731
                                              num_splits=0)
        diff = (one()[0].float() - auto()[0].float()).abs().max().item()
        t1, ta = cuda_ms(one), cuda_ms(auto)
        print(f"{b:>6} {mean:>6} {t1:>12.4f} {ta:>9.4f} {gbytes / t1:>9.2f} {gbytes / ta:>11.2f} {diff:.1e}", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--splits"]:
        return splits_sweep([int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]))
    spans = [int(a) for a in sys.argv[1:]] or [600, 1200]
    q = torch.randn(B, H, D, device=dev, dtype=dt)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=dev)
    rows = []
    for mean in spans:
        lens = [max(1, int(random.uniform(0.2, 1.8) * mean)) for _ in range(B)]
        gbytes = sum(lens) * KVH * D * 2 * 2 / 1e9
        for page in (256, 128, 64):
            k, v, table, used = case(lens, page)
            ref = None
            variants = {
                "varlen q (now)": lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, seqused_k=used, max_seqlen_q=1,
                                                                 page_table=table, causal=True),
                "batch q [B,1,H,D]": lambda: flash_attn_varlen_func(q.unsqueeze(1), k, v, seqused_k=used, page_table=table,
                                                                    causal=True),
                "varlen, num_splits auto": lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, seqused_k=used,
                                                                          max_seqlen_q=1, page_table=table, causal=True,
                                                                          num_splits=0),
                "batch q, num_splits auto": lambda: flash_attn_varlen_func(q.unsqueeze(1), k, v, seqused_k=used,
                                                                           page_table=table, causal=True, num_splits=0),
                "batch q, pack_gqa off": lambda: flash_attn_varlen_func(q.unsqueeze(1), k, v, seqused_k=used,
                                                                        page_table=table, causal=True, pack_gqa=False),
            }
            for name, fn in variants.items():
                try:
                    out = fn()
                    out = (out[0] if isinstance(out, tuple) else out).reshape(B, H, D)
                    if ref is None:
                        ref = out
                    diff = (out.float() - ref.float()).abs().max().item()
                    ms = cuda_ms(fn)
                    rows.append((mean, page, name, f"{ms:.3f}", f"{gbytes / ms:.2f}", f"{diff:.1e}"))
                except Exception as exc:  # noqa: BLE001
                    rows.append((mean, page, name, "fail", f"{type(exc).__name__}: {str(exc)[:80]}", ""))
            del k, v
            torch.cuda.empty_cache()
    print(f"{'ctx mean':>8} {'page':>5} {'variant':<28} {'ms':>7} {'TB/s':>6} maxdiff")
    for r in rows:
        print(f"{r[0]:>8} {r[1]:>5} {r[2]:<28} {r[3]:>7} {r[4]:>6} {r[5]}")


if __name__ == "__main__":
    main()
