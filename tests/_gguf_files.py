"""GGUF files for the tests, written with gguf-py from the default model's GGUF: its metadata (tokenizer
included) copied, its tensors requantized to other formats."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from nanoplug.bench.checkpoints import quantize_q4_k  # noqa: F401  (gguf-py cannot quantize Q4_K)

# the mixed file: every block format the CPU kernels serve, fused layers whose parts differ in format,
# and an F16 embedding (dequantized at load: a dense tied LM head). Q4_K needs rows that are whole
# super-blocks of 256, which only ffn_down's 1536 inputs are.
MIXED = {"token_embd": "F16", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q4_K"}


def requantize(source: Path, out: Path, formats: dict[str, str]) -> Path:
    """Copy `source` to `out` with each tensor whose GGUF name holds a key of `formats` (e.g. "attn_q")
    stored in that format instead (dequantized by gguf-py, requantized); others stay as they are."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        fmt = next((f for key, f in formats.items() if f".{key}." in f"." + t.name or t.name.startswith(key + ".")), None)
        if fmt is None or fmt == t.tensor_type.name:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        qtype = gguf.GGMLQuantizationType[fmt]
        if fmt == "F16":
            writer.add_tensor(t.name, values.astype(np.float16))
        elif fmt == "Q4_K":
            writer.add_tensor(t.name, quantize_q4_k(values), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# the largest |w| of random blocks is about 0.2: the float16 factor d (and dmin) of each type scaled by
# 0.2 / (its largest |scale| * its largest |quant|)
_RANDOM_D = {"Q6_K": 5e-5, "Q5_K": 1e-4, "Q3_K": 1.5e-3, "Q2_K": 4e-3, "IQ4_XS": 5e-5, "Q5_0": 1e-2, "Q5_1": 6e-3,
             "IQ4_NL": 1.5e-3}
_HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q5_K": (0, 2),
           "Q6_K": (208,), "IQ4_XS": (0,)}


def random_blocks(fmt: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Random bytes as the blocks of a [n, k] weight of `fmt` (every bit pattern of its quants and scales),
    its float16 factors of either sign, `scale` times _RANDOM_D's magnitude: no quantizer involved."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in _HALVES[fmt]:
        mag = rng.uniform(0.05, 1.0, (n, k // block)) * _RANDOM_D[fmt] * scale
        vals = (mag * rng.choice([-1, 1], (n, k // block))).astype(np.float16)
        raw[..., at:at + 2] = vals.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def with_random_blocks(source: Path, out: Path, formats: dict[str, str], seed: int = 0) -> Path:
    """Copy `source` to `out` with each tensor whose GGUF name holds a key of `formats` replaced by random
    blocks of that format (random_blocks), for a model of every block type whatever quantizer is at hand."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for i, t in enumerate(reader.tensors):
        fmt = next((f for key, f in formats.items() if f".{key}." in "." + t.name), None)
        if fmt is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])
        writer.add_tensor(t.name, random_blocks(fmt, rows, cols, seed + i), raw_dtype=gguf.GGMLQuantizationType[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
