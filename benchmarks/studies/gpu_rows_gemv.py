"""A candidate small-GEMM kernel whose cost grows little with the rows (issue 37: a verification's up to 8 rows at
about a one-row step's price, bit-equal to one row): each thread keeps float32 partial products of its own K
elements for every row across the whole reduction and the lanes reduce once at the end (the current kernel
reduces a whole K chunk across the program's threads for every row, and at 8 rows holds M x BLOCK_N x BLOCK_K
products at once). Swept over launch configurations on the decoder weight shapes of SmolLM2-135M, Qwen3-0.6B and
Qwen3-8B against the current kernel and cuBLAS, at 1, 2, 4 and 8 rows, with each row checked bit-equal to itself
alone. Each time is a CUDA graph of products over enough weight copies that none is read from L2.

    python3 benchmarks/studies/gpu_rows_gemv.py [--shapes smollm2,0.6b,8b] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from nanoplug.kernels.cuda import small_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402  (calls captured in one CUDA graph, the median replay)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_row_invariance import L2_DEFEAT_BYTES, SHAPES, kernel  # noqa: E402

triton, tl = small_gemm.triton, small_gemm.tl
ROWS = (1, 2, 4, 8)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, M_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def rows_gemm(x, w, y, block_n, block_k, warps, stages):
    (rows, k), n = x.shape, w.shape[0]
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, rows, n, k, x.stride(0), w.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(rows),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2,0.6b,8b")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    configs = [(4, 256, 4, 2), (8, 256, 8, 2), (8, 256, 4, 2), (4, 512, 4, 2), (8, 512, 8, 2), (16, 256, 8, 2),
               (4, 256, 4, 3), (8, 256, 8, 3), (2, 256, 2, 2), (4, 128, 4, 2)]
    if args.quick:
        configs = configs[:3]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name())
    totals: dict = {}
    for shape in args.shapes.split(","):
        print(f"\n{shape}: us per product at rows {ROWS}; 'DIFFER' where a row of M differs from itself alone")
        for name, (n, k) in SHAPES[shape].items():
            if name == "lm_head":
                continue
            copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            xs = torch.randn(max(ROWS), k, device=dev, dtype=torch.bfloat16)
            line = {}
            for label in ["cublas", "current"] + configs:
                cells = []
                for rows in ROWS:
                    x = xs[:rows]
                    y = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
                    turn = itertools.cycle(range(copies))
                    if label == "cublas":
                        fn = lambda: torch.mm(x, ws[next(turn)].t(), out=y)  # noqa: E731
                        same = True
                    elif label == "current":
                        fn = lambda: kernel(x, ws[next(turn)])  # noqa: E731
                        same = True
                    else:
                        try:
                            together = rows_gemm(x, ws[0], torch.empty_like(y), *label)
                            alone = torch.cat([rows_gemm(x[i:i + 1], ws[0], torch.empty_like(y[:1]), *label)
                                               for i in range(rows)])
                            same = torch.equal(together, alone)
                            ref = x.float() @ ws[0].float().t()
                            assert (together.float() - ref).abs().max().item() < 0.05
                        except Exception as exc:  # noqa: BLE001  (a configuration the compiler refuses)
                            cells.append(f"{type(exc).__name__}")
                            break
                        fn = lambda: rows_gemm(x, ws[next(turn)], y, *label)  # noqa: E731
                    t = graph_us(fn, calls=copies)
                    cells.append(f"{t:6.1f}{'' if same else ' DIFFER'}")
                    totals.setdefault((shape, str(label), rows), 0.0)
                    totals[(shape, str(label), rows)] += t
                line[str(label)] = cells
            print(f"  {name} N={n} K={k}")
            for label, cells in line.items():
                print(f"    {label:22} " + " ".join(cells), flush=True)
            del ws
            torch.cuda.empty_cache()
    print("\nper layer (q/k/v + o + gate/up + down), us at rows", ROWS)
    for shape in args.shapes.split(","):
        for label in ["cublas", "current"] + [str(c) for c in configs]:
            cells = [totals.get((shape, label, r)) for r in ROWS]
            if all(c is not None for c in cells):
                print(f"RESULT {shape:8} {label:22} " + " ".join(f"{c:7.1f}" for c in cells))


if __name__ == "__main__":
    main()
