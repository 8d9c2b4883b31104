"""A GGUF file read as a Hugging Face checkpoint: its tensors under the Hugging Face names, still in
the file's blocks, and its config and tokenizer built from the metadata by transformers.

The tensors are gguf-py's memory-mapped views, so nothing is dequantized until asked: a quantized
tensor is handed on as its blocks (uint8 [rows, bytes per row]) and a weight format keeps them that
way; `dequantize()` gives gguf-py's own float32 values, the oracle every kernel is checked against.
llama.cpp's converter permutes the rows of a llama model's q and k projections (its RoPE pairs
adjacent features, Hugging Face's pairs the two halves); the rows are put back as transformers does,
which moves whole rows of blocks and so works on quantized rows too.
"""
from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nanoplug.api.errors import ModelLoadError

# GGUF architectures whose tensors map onto nanoplug's decoder, and their Hugging Face architecture
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_SKIPPED = {"rope_freqs"}  # llama3 rope factors: the config's rope_scaling gives them
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a tensor of a llama/Qwen2/Qwen3 GGUF (None: a tensor nanoplug does not load)."""
    m = _BLK.match(gguf_name)
    if m:
        part = _BLOCK.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _SKIPPED or base not in _GLOBAL:
        return None
    return f"{_GLOBAL[base]}.{suffix}"


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


class GGUFFile:
    """The metadata and tensors of one GGUF file (memory-mapped by gguf-py)."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # gguf-py raises ValueError/struct errors on a damaged or foreign file
            raise ModelLoadError(f"{str(self.path)!r} is not a readable GGUF file: {exc}") from exc
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{self.path.name} is a GGUF of architecture {self.arch!r}; nanoplug reads "
                                 f"{', '.join(ARCHITECTURES)} GGUF files (or pass a Hugging Face checkpoint folder)")
        self.num_heads = int(self.field(f"{self.arch}.attention.head_count"))
        self.num_kv_heads = int(self.field(f"{self.arch}.attention.head_count_kv", self.num_heads))

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            if default is None:
                raise ModelLoadError(f"{self.path.name} has no {key!r} metadata entry")
            return default
        return f.contents()

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor nanoplug loads, under its Hugging Face name, q/k rows back in Hugging Face order."""
        for t in self._reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest dim first
            raw = t.data
            if self.arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name) and len(shape) == 2:
                heads = self.num_heads if ".attn_q." in t.name else self.num_kv_heads
                raw = np.asarray(raw)[unpermute_rows(shape[0], heads)]
            yield GGUFTensor(name, t.name, int(t.tensor_type), t.tensor_type.name, shape, raw)

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
                config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        config.architectures = [ARCHITECTURES[self.arch]]
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

    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence token, and the end-of-turn token where the file names one."""
        ids = [int(self.field("tokenizer.ggml.eos_token_id"))]
        eot = self._reader.fields.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot.contents()) not in ids:
            ids.append(int(eot.contents()))
        return ids

    def write_float32_weights(self, out: Path) -> None:
        """Every tensor, dequantized by gguf-py, as one float32 safetensors file (the oracle's weights)."""
        from safetensors.torch import save_file

        save_file({t.name: t.dequantize() for t in self.tensors()}, str(out), metadata={"format": "pt"})


def write_checkpoint(gguf: GGUFFile, out: Path, config: Any, tokenizer: Any, eos_token_ids: list[int]) -> None:
    """Write the config, generation config and tokenizer of a GGUF checkpoint folder into `out` (the
    weights are the caller's: the file itself, a link to it, or float32 safetensors)."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    GenerationConfig(bos_token_id=getattr(config, "bos_token_id", None), eos_token_id=list(eos_token_ids),
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out))
