"""A GGUF file read as a Hugging Face checkpoint: its tensors under the Hugging Face names, still in
the file's blocks, and its config and tokenizer built from the metadata by transformers.

The tensors are gguf-py's memory-mapped views, so nothing is dequantized until asked: a quantized
tensor is handed on as its blocks (uint8 [rows, bytes per row]) and a weight format keeps them that
way; `dequantize()` gives gguf-py's own float32 values, the oracle every kernel is checked against.
llama.cpp's converter permutes the rows of a llama model's q and k projections (its RoPE pairs
adjacent features, Hugging Face's pairs the two halves); the rows are put back as transformers does,
which moves whole rows of blocks and so works on quantized rows too. The other architectures' conventions
(Mixtral and Mistral as llama, merged experts, Gemma's norms, Phi-3's fused layers) are gguf_arches.py's.

`checkpoint_folder(file)` turns any GGUF file into a checkpoint folder nanoplug loads like a Hugging
Face one (config, tokenizer, the file linked in), built once per file in the cache; its config says
`quantization_config: {"quant_method": "gguf"}`, which the engine reads to pick the weight format.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nanoplug.api.errors import ModelLoadError
from nanoplug.checkpoint import gguf_arches
from nanoplug.checkpoint.gguf_arches import ARCHITECTURES  # noqa: F401  (the GGUF architectures read)

_MISSING = object()


def hf_name(gguf_name: str, kind: str = "llama") -> str | None:
    """The Hugging Face name of a tensor of a GGUF of `kind` (gguf_arches.variant; None: a tensor nanoplug
    does not load)."""
    return gguf_arches.hf_name(kind, gguf_name)


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)


@dataclass
class GGUFTensor:
    """One tensor of the file under its Hugging Face name. `raw` is the file's data in torch order:
    float32/float16 values [*shape], or for a block format uint8 [rows, bytes per row]."""

    name: str
    gguf_name: str
    ggml_type: int          # gguf.GGMLQuantizationType value
    type_name: str          # "Q4_1", "F32", ...
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a weight
    raw: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.type_name not in ("F32", "F16", "BF16")

    # what the layer library's loaders ask of a checkpoint tensor: its shape, and a range of its rows
    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "GGUFTensor":
        if dim != 0:
            raise ValueError(f"{self.gguf_name} ({self.type_name}) cannot be split along dim {dim}: a GGUF's "
                             "quantized tensors split by rows only (tensor parallelism is not served for them)")
        return GGUFTensor(self.name, self.gguf_name, self.ggml_type, self.type_name,
                          (length, *self.shape[1:]), self.raw[start:start + length])

    def __getitem__(self, rows: slice) -> "GGUFTensor":
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("a GGUF tensor is indexed by a range of rows only")
        start, stop, _ = rows.indices(self.shape[0])
        return self.narrow(0, start, max(stop - start, 0))

    def blocks(self) -> torch.Tensor:
        """The quantized blocks as a uint8 tensor [rows, bytes per row] (a copy: the file's pages are read-only)."""
        if not self.quantized:
            raise ValueError(f"{self.gguf_name} is {self.type_name}, not a block format")
        return torch.from_numpy(np.array(self.raw, dtype=np.uint8))

    def dequantize(self) -> torch.Tensor:
        """gguf-py's float32 values (a plain tensor is converted to float32)."""
        import gguf

        values = gguf.quants.dequantize(np.asarray(self.raw), gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape)

    def to_torch(self) -> torch.Tensor:
        """Plain tensors as float32 torch tensors, quantized ones as their blocks."""
        if self.quantized:
            return self.blocks()
        return torch.from_numpy(np.array(self.raw, dtype=np.float32)).reshape(self.shape)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """A GGUF file's scalar metadata and tensor directory, read without decoding its arrays (gguf-py's
    reader builds an object per vocabulary entry: seconds for a tokenizer of 49,152 tokens)."""

    def __init__(self, path: Path):
        import struct

        with open(path, "rb") as f:
            buf = f.read(1 << 20)
            pos = 0

            def need(n: int) -> None:
                nonlocal buf
                while pos + n > len(buf):
                    more = f.read(max(1 << 20, n))
                    if not more:
                        raise ValueError("the file ends inside its header")
                    buf += more

            def take(fmt: str):
                nonlocal pos
                size = struct.calcsize(fmt)
                need(size)
                value = struct.unpack_from(fmt, buf, pos)
                pos += size
                return value[0] if len(value) == 1 else value

            def string() -> str:
                nonlocal pos
                n = take("<Q")
                need(n)
                pos += n
                return buf[pos - n:pos].decode("utf-8", errors="replace")

            def skip(vtype: int) -> None:
                nonlocal pos
                if vtype == _STRING:
                    n = take("<Q")
                    need(n)
                    pos += n
                elif vtype == _ARRAY:
                    etype, count = take("<I"), take("<Q")
                    if etype in _SCALARS:
                        size = struct.calcsize(_SCALARS[etype]) * count
                        need(size)
                        pos += size
                    elif etype == _STRING:  # a vocabulary: tens of thousands of strings, each length and skip
                        length = struct.Struct("<Q").unpack_from
                        for _ in range(count):
                            need(8)
                            pos += 8 + length(buf, pos)[0]
                        need(0)
                    else:
                        for _ in range(count):
                            skip(etype)
                else:
                    take(_SCALARS[vtype])

            if take("<I") != 0x46554747:  # "GGUF"
                raise ValueError("no GGUF magic number at its start")
            self.version = take("<I")
            if self.version < 2:
                raise ValueError(f"GGUF version {self.version} is too old (2 and later are read)")
            n_tensors, n_kv = take("<Q"), take("<Q")
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key, vtype = string(), take("<I")
                if vtype == _STRING:
                    self.fields[key] = string()
                elif vtype in _SCALARS:
                    self.fields[key] = take(_SCALARS[vtype])
                else:
                    skip(vtype)  # arrays (the vocabulary, merges): transformers reads those
            self.tensors = []
            for _ in range(n_tensors):
                name, ndim = string(), take("<I")
                dims = [take("<Q") for _ in range(ndim)]
                ttype, offset = take("<I"), take("<Q")
                self.tensors.append((name, dims, ttype, offset))
            align = int(self.fields.get("general.alignment", 32))
            self.data_start = (pos + align - 1) // align * align


class GGUFFile:
    """The metadata and tensors of one GGUF file (its data memory-mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self._header = _Header(self.path)
        except (ValueError, KeyError, OSError) as exc:
            raise ModelLoadError(f"{str(self.path)!r} is not a readable GGUF file: {exc}") from exc
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{self.path.name} is a GGUF of architecture {self.arch!r}; nanoplug reads "
                                 f"{', '.join(ARCHITECTURES)} GGUF files (or pass a Hugging Face checkpoint folder)")
        self.kind = gguf_arches.variant(self.arch, self.field)
        self.num_heads = int(self.field(f"{self.arch}.attention.head_count"))
        self.num_kv_heads = int(self.field(f"{self.arch}.attention.head_count_kv", self.num_heads))

    def field(self, key: str, default: Any = _MISSING) -> Any:
        """A scalar or string metadata value (arrays are not read); without a default, a missing one is an error."""
        value = self._header.fields.get(key)
        if value is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path.name} has no {key!r} metadata entry")
            return default
        return value

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape in torch order, by its GGUF name."""
        return {name: tuple(int(d) for d in reversed(dims)) for name, dims, _, _ in self._header.tensors}

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor nanoplug loads, under its Hugging Face name, as the checkpoint held it: q/k rows back in
        Hugging Face order, Gemma's norms without the converter's + 1, merged experts one tensor per expert."""
        import gguf

        data = np.memmap(self.path, mode="r")
        for gguf_name, dims, ttype, offset in self._header.tensors:
            name = hf_name(gguf_name, self.kind)
            if name is None:
                continue
            qtype = gguf.GGMLQuantizationType(ttype)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest dim first
            start = self._header.data_start + offset
            nbytes = int(np.prod(dims)) // block * size
            raw = data[start:start + nbytes]
            if qtype.name in ("F32", "F16", "BF16"):
                raw = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype.name]).reshape(shape)
            else:
                raw = raw.reshape(*shape[:-1], shape[-1] // block * size)
            if self.arch in gguf_arches.PERMUTED and (".attn_q." in gguf_name or ".attn_k." in gguf_name) \
                    and len(shape) == 2:
                heads = self.num_heads if ".attn_q." in gguf_name else self.num_kv_heads
                raw = np.asarray(raw)[unpermute_rows(shape[0], heads)]
            if self.arch in gguf_arches.NORM_PLUS_ONE and gguf_arches.is_norm(gguf_name):
                if qtype.name not in ("F32", "F16"):
                    raise ModelLoadError(f"{self.path.name}: norm {gguf_name} is {qtype.name}, not F32 or F16")
                raw, qtype = np.asarray(raw, dtype=np.float32) - 1, gguf.GGMLQuantizationType.F32
            if name.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp's {n_embd}: one row
                shape, raw = (1, shape[0]), np.asarray(raw).reshape(1, -1)
            if "{e}" in name:
                if len(shape) != 3:
                    raise ModelLoadError(f"{self.path.name}: {gguf_name} has shape {shape}, not [experts, out, in]")
                for e in range(shape[0]):
                    yield GGUFTensor(name.format(e=e), gguf_name, int(qtype), qtype.name, shape[1:], raw[e])
                continue
            yield GGUFTensor(name, gguf_name, int(qtype), qtype.name, shape, raw)

    def hf_config_and_tokenizer(self, progress: bool = False) -> tuple[Any, Any]:
        """The Hugging Face config and tokenizer transformers builds from the metadata (no weights read)."""
        from transformers import AutoConfig, AutoTokenizer
        from transformers.utils import logging as hf_logging

        quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with quiet:
                folder, name = str(self.path.parent), self.path.name
                config = self._config(lambda: AutoConfig.from_pretrained(folder, gguf_file=name,
                                                                         local_files_only=True))
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        config.architectures = [gguf_arches.hf_architecture(self.arch, self.field)]
        config.dtype = "float32"
        # GGUF stores the epsilon as float32 (1e-5 reads back as 9.9999997e-06): take the shortest
        # decimal that rounds to the same float32, the value the original config held
        eps = getattr(config, "rms_norm_eps", None)
        if eps is not None:
            config.rms_norm_eps = float(np.format_float_positional(np.float32(eps), unique=True, trim="-"))
        for key in ("quantization_config", "_model_name_or_path"):  # GGUF-only config entries
            if hasattr(config, key):
                delattr(config, key)
        return config, tokenizer

    def _config(self, from_transformers: Any) -> Any:
        """transformers' config for the architectures it reads whole (llama, qwen2, qwen3), else gguf_arches'."""
        if self.arch not in gguf_arches.TRANSFORMERS_CONFIG or self.kind != self.arch:
            return gguf_arches.hf_config(self.arch, self.field, self.shapes())
        gguf_arches.check_no_window(self.arch, self.field)
        config = from_transformers()
        if config.model_type == "mistral":  # transformers' guess from general.name; the file is a llama one
            from transformers import LlamaConfig

            config = LlamaConfig(**{k: v for k, v in config.to_dict().items()
                                    if k not in ("model_type", "sliding_window", "architectures")})
        return config

    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence token, and the end-of-turn token where the file names one."""
        ids = [int(self.field("tokenizer.ggml.eos_token_id"))]
        eot = self._header.fields.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in ids:
            ids.append(int(eot))
        return ids

    def write_float32_weights(self, out: Path) -> None:
        """Every tensor, dequantized by gguf-py, as one float32 safetensors file (the oracle's weights)."""
        from safetensors.torch import save_file

        save_file({t.name: t.dequantize() for t in self.tensors()}, str(out), metadata={"format": "pt"})


QUANT_METHOD = "gguf"  # the checkpoint config's quantization_config.quant_method for a GGUF folder


def write_checkpoint(gguf: GGUFFile, out: Path, config: Any, tokenizer: Any, eos_token_ids: list[int]) -> None:
    """Write the config, generation config and tokenizer of a GGUF checkpoint folder into `out` (the
    weights are the caller's: the file itself or a link to it). The config names the weight format."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    # written into the file, not as a config attribute: whether save_pretrained keeps such an attribute
    # depends on the transformers release
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["quantization_config"] = {"quant_method": QUANT_METHOD, "file": gguf.path.name}
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out))
    GenerationConfig(bos_token_id=getattr(config, "bos_token_id", None), eos_token_id=list(eos_token_ids),
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out))


def gguf_in(folder: Path) -> Path | None:
    """The GGUF file whose tensors are a checkpoint folder's weights (None: it has safetensors instead)."""
    files = sorted(folder.glob("*.gguf"))
    if not files or any(folder.glob("*.safetensors")):
        return None
    if len(files) > 1:
        raise ModelLoadError(f"{folder} holds several GGUF files ({', '.join(f.name for f in files)}); keep one")
    return files[0]


def checkpoint_folder(path: str | Path, cache: Path, progress: bool = False) -> Path:
    """A checkpoint folder for the GGUF file `path`: its config and tokenizer (built by transformers from
    the metadata, which takes seconds, so once per file: keyed by path, size and modification time) and a
    link to the file, under `cache`."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache / f"{path.stem}-{key}"
    if (target / "config.json").is_file() and (target / path.name).exists():
        return target
    gguf = GGUFFile(path)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache))
    try:
        config, tokenizer = gguf.hf_config_and_tokenizer(progress)
        write_checkpoint(gguf, tmp, config, tokenizer, gguf.eos_token_ids())
        os.symlink(path, tmp / path.name)
        (tmp / "nanoplug_source.json").write_text(json.dumps({"gguf": str(path), "size": stat.st_size}) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another process published it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
