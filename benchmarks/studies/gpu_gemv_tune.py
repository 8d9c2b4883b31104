"""Batch-1 decode's matrix products at the 8B shape (issue 38): the small-GEMM kernel's launch configurations swept
on each of the decoder's weight shapes and the LM head, against cuBLAS and against a plain copy of the same bytes
(the rate a product that only streams its weight can reach). Each figure is a CUDA graph of products over enough
weight copies that none is read from L2, as in a real step where every layer's weights evict the last one's.

    python3 benchmarks/studies/gpu_gemv_tune.py [--rows 1] [--quick] [--shape 8b|0.6b]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoplug.kernels.cuda import small_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402  (calls captured in one CUDA graph, the median replay)

triton = small_gemm.triton

SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)},
          "0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)}}
LAYERS = {"8b": 36, "0.6b": 28}
L2_DEFEAT_BYTES = 512 << 20


def graph_time(fn, copies: int) -> float:
    """Seconds per call of fn(i), i going over the copies: `graph_us` of the calls over every copy in one graph."""
    turn = itertools.cycle(range(copies))
    return graph_us(lambda: fn(next(turn)), calls=copies) / 1e6


def launch(x, w, y, block_n, block_k, warps, stages):
    (rows, k), n = x.shape, w.shape[0]
    small_gemm._small_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, w, y, rows, n, k, x.stride(0), w.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(rows),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=False, num_warps=warps,
        num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES), help="Qwen3-8B's or Qwen3-0.6B's")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    block_ns, block_ks, warps_list, stages_list = ([2, 4, 8, 16], [512, 1024, 2048, 4096], [4, 8], [2, 3, 4]) \
        if not args.quick else ([4, 8], [1024], [4, 8], [2, 4])
    print(f"{torch.cuda.get_device_name()}, rows {args.rows}, the {args.shape} shape")
    summary = []
    for name, (n, k) in SHAPES[args.shape].items():
        nbytes = n * k * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(args.rows, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(args.rows, n, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        dst = torch.empty_like(ws[0])
        t_copy = graph_time(lambda i: dst.copy_(ws[i]), copies)  # reads and writes: 2 x the bytes
        t_cublas = graph_time(lambda i: torch.mm(x, ws[i].t(), out=y), copies)
        t_now = graph_time(lambda i: small_gemm.linear(x, ws[i]), copies)
        rate = lambda t: nbytes / t / 1e12  # noqa: E731
        print(f"\n{name} N={n} K={k} ({nbytes / 1e6:.1f} MB, {copies} copies): copy {2 * rate(t_copy):.2f} TB/s "
              f"(read+write), cuBLAS {1e6 * t_cublas:.1f} us {rate(t_cublas):.2f} TB/s, current kernel "
              f"{1e6 * t_now:.1f} us {rate(t_now):.2f} TB/s", flush=True)
        results = []
        for bn, bk, wp, st in itertools.product(block_ns, block_ks, warps_list, stages_list):
            if bk > triton.next_power_of_2(k):
                continue
            try:
                launch(x, ws[0], y, bn, bk, wp, st)
                torch.cuda.synchronize()
                err = (y.float() - ref).abs().max().item()
                t = graph_time(lambda i: launch(x, ws[i], y, bn, bk, wp, st), copies)
            except Exception as exc:  # noqa: BLE001  (a configuration the compiler refuses: out of resources)
                print(f"   BLOCK_N={bn} BLOCK_K={bk} warps={wp} stages={st}: {type(exc).__name__}")
                continue
            results.append((t, bn, bk, wp, st, err))
        results.sort()
        for t, bn, bk, wp, st, err in results[:6]:
            print(f"   {1e6 * t:7.1f} us {rate(t):.2f} TB/s  BLOCK_N={bn:<3} BLOCK_K={bk:<5} warps={wp} stages={st}"
                  f"  max err {err:.3g}")
        best = results[0]
        summary.append((name, 1e6 * t_now, 1e6 * best[0], 1e6 * t_cublas, best[1:5]))
        del ws
        torch.cuda.empty_cache()
    layers = LAYERS[args.shape]
    per_step = {"qkv": layers, "o": layers, "gate_up": layers, "down": layers, "lm_head": 1}
    now = sum(per_step[s[0]] * s[1] for s in summary) / 1e3
    best = sum(per_step[s[0]] * s[2] for s in summary) / 1e3
    print(f"\nper decode step ({layers} layers + LM head): current {now:.3f} ms, best configs {best:.3f} ms")
    for name, t_now, t_best, t_cublas, cfg in summary:
        print(f"RESULT {name}: current {t_now:.1f} us, best {t_best:.1f} us {cfg}, cuBLAS {t_cublas:.1f} us")


if __name__ == "__main__":
    main()
