"""The GGUF types kept in the file's blocks on one GPU (kernels/gguf/triton_kquants.py): the GEMV of each type at
decode shapes against bf16's, and the default model's Q4_K_M decode on CUDA.

    python3 benchmarks/gpu_gguf_kquants.py                 # kernels, then decode (about 3 minutes)
    python3 benchmarks/gpu_gguf_kquants.py kernels
    python3 benchmarks/gpu_gguf_kquants.py decode --gguf SmolLM2-135M-Instruct.Q4_K_M.gguf

kernels: x [1, K] bf16 times each type's weight [N, K] (random blocks, 8B-layer shapes), captured in a CUDA
graph (benchmarks/_cuda_timing.py): microseconds a call and GB/s of weight bytes read, against torch.mm on
the bf16 weight.

decode: batch-1 decode of the default model (SmolLM2-135M-Instruct) stored as llama.cpp's Q4_K_M preset
stores it, through `gguf_triton`, against the same file dequantized to bf16 and the default Q4_1 file
(benchmarks/gpu_gguf.py's engine runs: a child process each, CUDA graphs, 128-token prompt, 256 tokens).
`--gguf` takes the file llama.cpp wrote (benchmarks/quantize_gguf.py); without it (the GPU machine has no
llama.cpp) the default model's weights are requantized to the tensor types llama.cpp's Q4_K_M gave each
tensor (tests/data/smollm2_q4_k_m_types.json, written with the test data) by gguf-py (Q8_0, Q5_0) and
nanoplug.bench.checkpoints (Q4_K, Q6_K): the same types and bytes, other rounding.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from _cuda_timing import graph_us

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import gpu_gguf  # noqa: E402  (its engine runs)

OUT = Path(os.environ.get("OUT", "/tmp/out"))
TYPES = ROOT / "tests" / "data" / "smollm2_q4_k_m_types.json"
SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]


def kernels_bench(device: str) -> list[tuple]:
    import torch

    from _gguf_files import random_blocks
    from nanoplug.kernels.gguf import triton_kquants as kq

    rows = []
    for n, k in SHAPES if device == "cuda" else [(256, 512)]:
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        dense = torch.randn(n, k, device=device, dtype=x.dtype)
        out = torch.empty(1, n, device=device, dtype=x.dtype)
        base = graph_us(lambda: torch.mm(x, dense.t(), out=out)) if device == "cuda" else float("nan")
        rows.append(("bf16", n, k, base, n * k * 2 / base / 1e3))
        for fmt in kq.FORMATS:
            w = kq.raw_blocks(fmt, torch.from_numpy(random_blocks(fmt, n, k)), n, k).to(torch.device(device))
            us = graph_us(lambda: kq.linear(x, w, out)) if device == "cuda" else float("nan")
            if device != "cuda":
                kq.linear(x, w, out)
            rows.append((fmt, n, k, us, w.nbytes / us / 1e3))
            print(f"{fmt:7s} [{n}, {k}]: {us:8.1f} us  {w.nbytes / us / 1e3:7.0f} GB/s  (bf16 {base:.1f} us)", flush=True)
    return rows


def q4_k_m_file(work: Path) -> Path:
    """The default model requantized to the tensor types of llama.cpp's Q4_K_M preset (see the docstring)."""
    import gguf
    import numpy as np

    from nanoplug.bench.checkpoints import quantize_q4_k, quantize_q6_k
    from nanoplug.checkpoint.default_model import default_gguf_path

    out = work / "SmolLM2-135M-Instruct.Q4_K_M-layout.gguf"
    if out.exists():
        return out
    types = json.loads(TYPES.read_text())
    reader = gguf.GGUFReader(str(default_gguf_path(progress=False)))
    work.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        fmt = types[t.name]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        if fmt in ("F32", "F16"):
            writer.add_tensor(t.name, values.astype(np.float16 if fmt == "F16" else np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[fmt]
        blocks = (quantize_q4_k(values) if fmt == "Q4_K" else quantize_q6_k(values) if fmt == "Q6_K"
                  else gguf.quants.quantize(values, qtype))
        writer.add_tensor(t.name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def decode_bench(gguf_path: str | None, device: str) -> dict:
    from nanoplug.checkpoint.default_model import default_gguf_path

    path = Path(gguf_path) if gguf_path else q4_k_m_file(gpu_gguf.WORK)
    results = {}
    for label, file, quantization in (("Q4_K_M (gguf_triton)", path, "Q4_K_M"), ("Q4_K_M dequantized, bf16", path, "none"),
                                      ("Q4_1 default (gguf_triton)", default_gguf_path(progress=False), "Q4_1")):
        try:
            results[label] = gpu_gguf.run_engine(file, quantization, device)
        except Exception:  # noqa: BLE001  (one failure leaves the others' figures)
            traceback.print_exc()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", nargs="?", default="all", choices=["all", "kernels", "decode"])
    parser.add_argument("--gguf", default=None, help="the Q4_K_M file llama.cpp wrote (default: requantized here)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test (TRITON_INTERPRET=1 for the kernels)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    gpu_gguf.WORK.mkdir(parents=True, exist_ok=True)
    kern, dec = [], {}
    if args.stage in ("all", "kernels"):
        kern = kernels_bench(args.device)
    if args.stage in ("all", "decode"):
        dec = decode_bench(args.gguf, args.device)
    (OUT / "gpu_gguf_kquants.json").write_text(json.dumps({"kernels": kern, "decode": dec}, indent=1, default=str))
    if kern:
        print("\n| type | N x K | us/call | GB/s |\n| --- | --- | ---: | ---: |")
        for fmt, n, k, us, gbs in kern:
            print(f"| {fmt} | {n} x {k} | {us:.1f} | {gbs:.0f} |")
    if dec:
        print("\n| default model | decode ms/token | prefill ms | weights GB |\n| --- | ---: | ---: | ---: |")
        for label, f in dec.items():
            print(f"| {label} | {f['decode_ms']:.2f} | {f['prefill_ms']:.0f} | {f['weights_gb']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
