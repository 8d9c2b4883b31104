"""The int4 dequantize kernel of the big-batch path (triton_w4a16.dequantize: the weight into a bf16 scratch, then
cuBLAS) against variants: values opened two at a time by w4a16_gemm's PTX instead of float32 shifts, several groups
a program, other tile heights and warps. On the 8B shape's four linears; each variant's output checked equal to
`dequantize_int4(..., bfloat16)`, each call in a CUDA graph over enough copies that none is read from L2. TB/s
counts the words and scales read and the bf16 written. ("tree": `triton_w4a16.dequantize` as it is now.)

`--crossover 128,192,256`: at each row count, the tensor-core GEMM (w4a16_gemm.matmul) against the tree's
dequantization + cuBLAS, ms a step of the 36 layers' linears (where DEQUANT_ROWS belongs).

    python3 benchmarks/studies/gpu_w4a16_dequant.py [--crossover 128,192,256,384]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from nanoplug.kernels.quant import int4, triton_w4a16, w4a16_gemm

triton, tl = triton_w4a16.triton, triton_w4a16.tl
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402
from gpu_quant_kernels import LAYERS  # noqa: E402
from studies.gpu_row_invariance import L2_DEFEAT_BYTES  # noqa: E402


@triton.jit
def _dequant_pairs(qw_ptr, s_ptr, out_ptr, N, K, sqn, ssn, son, STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Symmetric groups of 128: STEPS groups a program, each [BLOCK_N, 16] words opened by the GEMM's PTX."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rw = tl.arange(0, 16)
    rk = tl.arange(0, 128)
    z = tl.full((BLOCK_N,), 8.0, tl.float32)  # the symmetric zero
    for i in tl.static_range(STEPS):
        g = pid_k * STEPS + i
        words = tl.load(qw_ptr + rn[:, None] * sqn + (g * 16 + rw)[None, :], mask=n_ok[:, None], other=0)
        s = tl.load(s_ptr + rn * ssn + g, mask=n_ok, other=0.0)
        w = w4a16_gemm._unpack_pairs(words, z, s, False, BLOCK_N, 128)
        tl.store(out_ptr + rn[:, None] * son + (g * 128 + rk)[None, :], w, mask=n_ok[:, None])


def dequant_pairs(qweight, scales, out, steps, block_n, warps):
    n, k = out.shape
    _dequant_pairs[(triton.cdiv(n, block_n), k // 128 // steps)](
        qweight, scales, out, n, k, qweight.stride(0), scales.stride(0), out.stride(0), STEPS=steps,
        BLOCK_N=block_n, num_warps=warps)
    return out


def crossover(rows: list[int]) -> None:
    dev = torch.device("cuda")
    totals: dict[tuple[int, str], float] = {}
    for name, (n, k) in LAYERS.items():
        nbytes = n * k // 2 + n * k // 128 * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        ws = [(int4.pack_int4(torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)),
               (torch.rand(n, k // 128, device=dev) * 0.01).to(torch.bfloat16)) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            paths = {"GEMM": lambda i: w4a16_gemm.matmul(x, *ws[i], None, 128),
                     "dequantize + cuBLAS": lambda i: torch.nn.functional.linear(
                         x, triton_w4a16.dequantize(*ws[i], None, torch.bfloat16))}
            for tag, fn in paths.items():
                turn = itertools.cycle(range(copies))
                us = graph_us(lambda: fn(next(turn)), calls=copies)
                totals[m, tag] = totals.get((m, tag), 0.0) + us * 36 / 1e3
                print(f"{name:8} [{n}x{k}] rows {m} {tag}: {us:.1f} us", flush=True)
        del ws
        torch.cuda.empty_cache()
    print("\n| rows | GEMM | dequantize + cuBLAS |\n| ---: | ---: | ---: |")
    for m in rows:
        print(f"| {m} | {totals[m, 'GEMM']:.3f} | {totals[m, 'dequantize + cuBLAS']:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--crossover", default=None, help="row counts: the GEMM against dequantize + cuBLAS")
    args = p.parse_args()
    if args.crossover:
        print(torch.cuda.get_device_name())
        crossover([int(r) for r in args.crossover.split(",")])
        return
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    totals: dict[str, float] = {}
    for name, (n, k) in LAYERS.items():
        nbytes = n * k // 2 + n * k // 128 * 2 + n * k * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
        ws = [(int4.pack_int4(torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)),
               (torch.rand(n, k // 128, device=dev) * 0.01).to(torch.bfloat16)) for _ in range(copies)]
        outs = [torch.empty(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        ref = int4.dequantize_int4(ws[0][0], ws[0][1], None, torch.bfloat16)
        runs = {}
        turn = itertools.cycle(range(copies))
        assert torch.equal(triton_w4a16.dequantize(ws[0][0], ws[0][1], None, torch.bfloat16), ref)
        runs["tree"] = graph_us(lambda: triton_w4a16.dequantize(*ws[next(turn)], None, torch.bfloat16), calls=copies)
        for steps, block_n, warps in itertools.product((1, 2, 4), (16, 32, 64), (2, 4, 8)):
            tag = f"pairs s{steps} n{block_n} w{warps}"
            try:
                if not torch.equal(dequant_pairs(*ws[0], outs[0], steps, block_n, warps), ref):
                    print(f"{name} {tag}: WRONG")
                    continue
                turn = itertools.cycle(range(copies))
                runs[tag] = graph_us(lambda: (lambda i: dequant_pairs(*ws[i], outs[i], steps, block_n, warps))(
                    next(turn)), calls=copies)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} {tag}: {type(exc).__name__}: {str(exc)[:120]}")
        best = min((us, tag) for tag, us in runs.items() if tag != "tree")
        for tag, us in (("tree", runs["tree"]), ("best variant", best[0])):
            totals[tag] = totals.get(tag, 0.0) + us * 36 / 1e3
        for tag, us in sorted(runs.items(), key=lambda t: t[1])[:4] + [("tree", runs["tree"])]:
            print(f"{name:8} [{n}x{k}] {tag}: {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s)", flush=True)
        del ws, outs
        torch.cuda.empty_cache()
    print("\n| dequantize | ms a step of the 36 layers' linears |\n| --- | ---: |")
    for tag, ms in totals.items():
        print(f"| {tag} | {ms:.3f} |")


if __name__ == "__main__":
    main()
