"""GGUF files of tiny Hugging Face checkpoints, written as llama.cpp's converter (convert_hf_to_gguf.py) writes
them: its metadata keys per architecture (set_gguf_parameters), gguf-py's tensor names (TensorNameMap), and its
transforms (LlamaModel.permute of q/k for Mistral and Mixtral, written as `llama`; experts stacked into 3-D
`ffn_*_exps`; Gemma's norms as 1 + w; Gemma-2's lm_head dropped). The tokenizer's metadata is copied from the
default model's GGUF, so the checkpoints are written with its vocabulary size."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

# Hugging Face architecture -> the converter's GGUF architecture
GGUF_ARCH = {
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE, "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA, "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3, "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
}


def tokenizer_fields(source: Path) -> list[Any]:
    """The tokenizer.* metadata of a GGUF file (gguf-py reader fields)."""
    reader = gguf.GGUFReader(str(source))
    return [f for f in reader.fields.values() if f.name.startswith("tokenizer.")]


def _permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """LlamaModel.permute: the converter's q/k row order for llama.cpp's RoPE."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _sizes(w: gguf.GGUFWriter, c: dict) -> None:
    """The sizes every converter class writes first (TextModel's, and Gemma2Model's and Phi3MiniModel's own)."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])


def _metadata(w: gguf.GGUFWriter, hf_arch: str, c: dict) -> None:
    """set_gguf_parameters of TextModel and of the architecture's converter class."""
    rope = c.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    if hf_arch == "Phi3ForCausalLM":  # Phi3MiniModel writes its own, not TextModel's
        _sizes(w, c)
        w.add_rope_scaling_orig_ctx_len(c.get("original_max_position_embeddings") or c["max_position_embeddings"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(c.get("sliding_window") or 0)
        return
    if hf_arch == "Gemma2ForCausalLM":  # Gemma2Model writes its own too (no rope base: llama.cpp's 10000)
        _sizes(w, c)
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
        return
    # TextModel.set_gguf_parameters
    _sizes(w, c)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if hf_arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # LlamaModel
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    if hf_arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if hf_arch == "Qwen2MoeForCausalLM":
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if hf_arch == "Gemma3ForCausalLM":
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])


def _tensors(hf_arch: str, c: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """modify_tensors: the checkpoint's tensors renamed for TensorNameMap and transformed, experts stacked."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        t = t.float()
        if hf_arch == "Gemma2ForCausalLM" and name == "lm_head.weight":
            continue
        if hf_arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = _permute(t, c["num_attention_heads"], c["num_attention_heads"])
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = _permute(t, c["num_attention_heads"], c["num_key_value_heads"])
        if hf_arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM") and name.endswith("norm.weight"):
            t = t + 1
        parts = name.split(".")
        if ".experts." in name:  # model.layers.L.{mlp|block_sparse_moe}.experts.E.W.weight
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = t
            continue
        out[name] = t
    for (layer, w), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        if hf_arch == "MixtralForCausalLM":
            out[f"layers.{layer}.feed_forward.experts.{w}.weight"] = stacked
        else:
            out[f"model.layers.{layer}.mlp.experts.{w}.weight"] = stacked
    return out


def write_gguf(folder: str | Path, out: Path, tokenizer_source: list[Any], types: dict[str, str] | None = None) -> Path:
    """The GGUF of the checkpoint in `folder` as the converter writes it, every tensor F32 unless a key of `types`
    (a GGUF name part, e.g. "ffn_up_exps") names another type ("F16", "Q8_0")."""
    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    hf_arch = c["architectures"][0]
    arch = GGUF_ARCH[hf_arch]
    writer = gguf.GGUFWriter(str(out), arch=gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny {hf_arch}")
    _metadata(writer, hf_arch, c)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for field in tokenizer_source:
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    names = gguf.get_tensor_name_map(arch, c["num_hidden_layers"])
    tensors = load_file(str(folder / "model.safetensors"))
    for name, t in _tensors(hf_arch, c, tensors).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no name for {name}"
        values = t.numpy()
        fmt = next((f for key, f in (types or {}).items() if f".{key}." in "." + gguf_name), "F32")
        if fmt == "F32" or values.ndim == 1:
            writer.add_tensor(gguf_name, values.astype(np.float32))
        elif fmt == "F16":
            writer.add_tensor(gguf_name, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[fmt]
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
