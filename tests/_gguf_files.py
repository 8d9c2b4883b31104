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
