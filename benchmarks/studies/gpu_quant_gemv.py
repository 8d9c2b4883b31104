"""The decode GEMVs of pre-quantized weights (issue 35: batch-1 decode at least 2.5x bf16's in int4 W4A16, 1.7x in
block-scaled fp8) on the 8B shape's linear layers, against cuBLAS on bf16 weights of the same shape and against
the int4 words read alone by a kernel that only streams them (what the GEMV's access pattern allows), at 1 and 4
rows, and a one-row GEMV built up in parts (the words opened, times the activations, scaled) to see which part
costs; `--sweep`: their rows per program and K splits too. Each call in a CUDA graph over enough weight copies
that none is read from L2. `--old DIR`: another tree's GEMVs (its own choices) beside them, in one process.

    python3 benchmarks/studies/gpu_quant_gemv.py [--kinds int4,fp8] [--rows 1,4] [--old /tmp/old] [--sweep]
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path

import torch

from nanoplug.kernels.quant import fp8, int4, triton_fp8, triton_w4a16

triton, tl = triton_w4a16.triton, triton_w4a16.tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402  (calls captured in one CUDA graph, the median replay)
from gpu_quant_kernels import LAYERS  # noqa: E402  (the 8B shape's four linears)
from studies.gpu_row_invariance import L2_DEFEAT_BYTES  # noqa: E402

SWEEP = {"int4": [(bn, split, warps) for bn in (32, 64) for split in (None, 2, 4, 8) for warps in (2, 4, 8)],
         "fp8": [(bn, split, warps) for bn in (16, 32, 64) for split in (None, 2, 4, 8) for warps in (1, 2, 4)]}
BLOCK = (128, 128)


@triton.jit
def _words_only(qw_ptr, out_ptr, N, sqn, K_PER_SPLIT, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """The GEMV's reads alone (each word XOR-ed into a sum, nothing opened): what this access pattern can stream."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = qw_ptr + rn[:, None] * sqn + tl.arange(0, WORDS)[None, :]
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.int32)
    start = pid_k * K_PER_SPLIT // 8
    for w0 in range(start, start + K_PER_SPLIT // 8, WORDS):
        acc ^= tl.load(ptrs + w0, mask=(rn < N)[:, None], other=0)
    tl.store(out_ptr + pid_k * N + rn, tl.sum(acc, axis=1), mask=rn < N)


@triton.jit
def _gemv_parts(x_ptr, qw_ptr, s_ptr, out_ptr, N, sqn, ssn, K_PER_SPLIT, PART: tl.constexpr, BLOCK_N: tl.constexpr):
    """The one-row int4 GEMV (groups of 128, symmetric) built up in parts, to see which part costs: PART 1 opens
    the words into floats and sums them (no activations), 2 multiplies them by the activations (loaded a column
    at a time, as the GEMV does), 3 also scales them per group (the whole GEMV)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    start = pid_k * K_PER_SPLIT
    for k0 in range(start, start + K_PER_SPLIT, 128):
        words = tl.load(qw_ptr + rn[:, None] * sqn + (k0 // 8 + rw)[None, :], mask=(rn < N)[:, None], other=0)
        part = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for j in tl.static_range(8):
            w = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            if PART == 1:
                part += w
            else:
                x = tl.load(x_ptr + k0 + rw * 8 + j).to(tl.float32)
                part += w * x[None, :]
        if PART == 3:
            part *= tl.load(s_ptr + rn * ssn + k0 // 128, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        acc += part
    tl.atomic_add(out_ptr + rn, tl.sum(acc, axis=1), mask=rn < N)


def gemv_parts(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, part: int,
               block_n: int, split: int) -> None:
    n, kw = qweight.shape
    _gemv_parts[(triton.cdiv(n, block_n), split)](x, qweight, scales, out, n, qweight.stride(0), scales.stride(0),
                                                  kw * 8 // split, PART=part, BLOCK_N=block_n)


def words_only(qweight: torch.Tensor, out: torch.Tensor, block_n: int, split: int, warps: int, words: int) -> None:
    n, kw = qweight.shape
    _words_only[(triton.cdiv(n, block_n), split)](qweight, out, n, qweight.stride(0), kw * 8 // split,
                                                  BLOCK_N=block_n, WORDS=words, num_warps=warps)


def old_modules(tree: str) -> dict:
    """The other tree's kernel modules, by kind (each imports this tree's nanoplug.api, which both share)."""
    found = {}
    for kind, name in (("int4", "triton_w4a16"), ("fp8", "triton_fp8")):
        spec = importlib.util.spec_from_file_location(f"old_{name}", Path(tree) / f"nanoplug/kernels/quant/{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found[kind] = module
    return found


def weights(kind: str, n: int, k: int, dev: torch.device) -> tuple:
    if kind == "int4":
        return int4.pack_int4(torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)), (
            torch.rand(n, k // 128, device=dev) * 0.01).to(torch.bfloat16)
    return (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn), torch.rand(n // 128, k // 128, device=dev) * 1e-3


def reference(kind: str, x: torch.Tensor, w: tuple) -> torch.Tensor:
    if kind == "int4":
        return x.float() @ int4.dequantize_int4(w[0], w[1], None, torch.float32).t()
    return x.float() @ fp8.dequantize_blocks(w[0], w[1], BLOCK, torch.float32).t()


def call(kind: str, module, x: torch.Tensor, w: tuple, setting: tuple) -> torch.Tensor:
    bn, split, warps = setting
    more = {"warps": warps} if warps else {}  # (an older tree's GEMVs take no warps)
    if kind == "int4":
        return module.w4a16_matmul(x, w[0], w[1], None, split, bn, **more)
    return module.fp8_block_matmul(x, w[0], w[1], BLOCK, split, bn, **more)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="int4,fp8")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--old", default="", help="another tree whose GEMVs run beside these")
    parser.add_argument("--sweep", action="store_true", help="each setting of SWEEP (rows per program, K split, warps) too")
    args = parser.parse_args()
    old = old_modules(args.old) if args.old else {}
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    totals: dict[tuple[str, int], float] = {}
    for name, (n, k) in LAYERS.items():
        dense_copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(dense_copies)]
        rows_list = [int(r) for r in args.rows.split(",")]
        xs = {rows: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for rows in rows_list}
        for rows, x in xs.items():
            y = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            turn = itertools.cycle(range(dense_copies))
            us = graph_us(lambda: torch.mm(x, dense[next(turn)].t(), out=y), calls=dense_copies)
            totals[("cublas bf16", rows)] = totals.get(("cublas bf16", rows), 0.0) + us * 36 / 1e3
            print(f"{name:8} [{n}x{k}] rows {rows}: cublas bf16 {us:.1f} us ({2 * n * k / us / 1e6:.2f} TB/s)", flush=True)
        del dense
        for kind in args.kinds.split(","):
            nbytes = n * k // 2 + n * k // 128 * 2 if kind == "int4" else n * k
            copies = max(2, -(-L2_DEFEAT_BYTES // nbytes))
            ws = [weights(kind, n, k, dev) for _ in range(copies)]
            mine = triton_w4a16 if kind == "int4" else triton_fp8
            if kind == "int4":  # the reads alone, for the bound of this access pattern
                sink = torch.empty(8 * n, device=dev, dtype=torch.int32)
                reads = []
                for bn, split, warps, words in itertools.product((32, 64), (1, 4), (4, 8), (32, 64)):
                    turn = itertools.cycle(range(copies))
                    us = graph_us(lambda: words_only(ws[next(turn)][0], sink, bn, split, warps, words), calls=copies)
                    reads.append((us, f"n{bn} s{split} w{warps} words{words}"))
                us, tag = min(reads)
                print(f"{name:8} [{n}x{k}] int4 words read alone: best {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s) {tag}")
                x1 = torch.randn(k, device=dev, dtype=torch.bfloat16)
                sums = torch.zeros(n, device=dev, dtype=torch.float32)
                for part in (1, 2, 3):
                    parts = []
                    for bn, split in itertools.product((16, 32, 64), (1, 2, 4, 8)):
                        turn = itertools.cycle(range(copies))
                        us = graph_us(lambda: gemv_parts(x1, ws[next(turn)][0], ws[0][1], sums, part, bn, split),
                                      calls=copies)
                        parts.append((us, f"n{bn} s{split}"))
                    us, tag = min(parts)
                    print(f"{name:8} [{n}x{k}] int4 GEMV part {part}: best {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s) {tag}")
            for rows, x in xs.items():
                ref = reference(kind, x, ws[0])
                runs = {}
                for setting in [(None, None, None)] + (SWEEP[kind] if args.sweep else []):
                    tag = "this" if setting[0] is None else "this n{} s{} w{}".format(*setting)
                    try:
                        err = ((call(kind, mine, x, ws[0], setting).float() - ref).abs().max() / ref.abs().max()).item()
                        turn = itertools.cycle(range(copies))
                        runs[tag] = graph_us(lambda: call(kind, mine, x, ws[next(turn)], setting), calls=copies)
                    except Exception as exc:  # noqa: BLE001 (a setting that does not compile: say so, go on)
                        print(f"  {kind} {name} rows {rows} {tag}: {type(exc).__name__}: {str(exc)[:160]}")
                        continue
                    if err > (2e-2 if kind == "int4" else 0.15):  # (fp8: the activations' own rounding)
                        print(f"  {kind} {name} rows {rows} {tag}: WRONG (relative error {err:.2e})")
                if kind in old:
                    turn = itertools.cycle(range(copies))
                    runs["old"] = graph_us(lambda: call(kind, old[kind], x, ws[next(turn)], (None, None, None)),
                                           calls=copies)
                if not any(tag.startswith("this") for tag in runs):
                    continue
                best_us, best = min((us, tag) for tag, us in runs.items() if tag.startswith("this"))
                runs[f"{kind} best per layer"] = best_us
                for tag in ("this", "old", f"{kind} best per layer"):
                    if tag in runs:
                        key = (tag if tag.endswith("layer") else f"{kind} {tag}", rows)
                        totals[key] = totals.get(key, 0.0) + runs[tag] * 36 / 1e3
                cells = "  ".join(f"{tag} {runs[tag]:.1f} us ({nbytes / runs[tag] / 1e6:.2f} TB/s)"
                                  for tag in ("this", "old") if tag in runs)
                print(f"{name:8} [{n}x{k}] rows {rows}: {kind} {cells}  best: {best} {best_us:.1f} us", flush=True)
            del ws
            torch.cuda.empty_cache()
    print_totals(totals)


def print_totals(totals: dict[tuple[str, int], float]) -> None:
    """The table of (kernel, rows) -> ms a token in the 36 layers' linears, by rows then kernel."""
    print("\n| kernel | rows | ms a token in the 36 layers' linears |\n| --- | ---: | ---: |")
    for (tag, rows), ms in sorted(totals.items(), key=lambda t: (t[0][1], t[0][0])):
        print(f"| {tag} | {rows} | {ms:.3f} |")


if __name__ == "__main__":
    main()
