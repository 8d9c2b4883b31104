"""What llama.cpp's converter (convert_hf_to_gguf.py) writes for each architecture nanoplug reads from a GGUF,
read back: the Hugging Face name of each tensor, the converter's transforms to undo, and the config the
metadata describes, as llama.cpp itself would run the file.

The converter writes Mistral and Mixtral as `llama` (Mixtral with `llama.expert_count`), merges each MoE
layer's experts into 3-D `ffn_{gate,up,down}_exps` tensors (split here into one tensor per expert under the
checkpoint's names), stores Gemma's norms as `1 + w` (undone here: the Gemma plugins add the 1 themselves)
and keeps Phi-3's fused `qkv_proj` and `gate_up_proj` as `attn_qkv` and `ffn_up`. What the file does not say
is taken as llama.cpp takes it (Qwen-MoE routing, Gemma's layer pattern and attention scale); what llama.cpp
would silently drop from a file is refused with the reason, never run as something else.
"""
from __future__ import annotations

from typing import Any, Callable

from nanoplug.api.errors import ModelLoadError

# GGUF architecture -> Hugging Face architecture (a llama GGUF with experts is Mixtral: see hf_architecture)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
}
# the architectures whose config transformers builds from the metadata (the rest: hf_config below)
TRANSFORMERS_CONFIG = {"llama", "qwen2", "qwen3"}
# the architectures whose q/k rows the converter permutes (LlamaModel.permute: llama, Mistral, Mixtral)
PERMUTED = {"llama"}

GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DECODER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QWEN_MOE = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GEMMA = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
BLOCK = {
    "llama": _DECODER, "qwen2": _DECODER, "qwen3": _DECODER,
    "mixtral": {**_DECODER, "ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen2moe": {**_DECODER, **_QWEN_MOE}, "qwen3moe": {**_DECODER, **_QWEN_MOE},
    "phi3": {**_DECODER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {**_DECODER, **_GEMMA}, "gemma3": {**_DECODER, **_GEMMA},
}
# merged experts [E, out, in] -> one checkpoint tensor per expert ({e}: the expert)
_QWEN_EXPERTS = {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"}
EXPERTS = {
    "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1", "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    "qwen2moe": _QWEN_EXPERTS, "qwen3moe": _QWEN_EXPERTS,
}
# tensors written as 1 + w (Gemma's RMSNorm computes x * (1 + w)): every norm of these architectures
NORM_PLUS_ONE = {"gemma2", "gemma3"}
# gemma2 and gemma3 layer patterns llama.cpp hard-codes (set_swa_pattern): a layer slides unless il % n == n - 1
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# the 27B Gemmas scale q by (hidden / heads) ** -0.5, not head_dim ** -0.5; llama.cpp tells them by their layers
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_SKIPPED = {"rope_freqs"}  # llama3 rope factors: the config's rope_scaling gives them


def variant(arch: str, field: Callable[[str, Any], Any]) -> str:
    """The key of BLOCK/EXPERTS for a file: its architecture, or "mixtral" for a llama GGUF with experts."""
    if arch == "llama" and int(field("llama.expert_count", 0) or 0) > 0:
        return "mixtral"
    return arch


def hf_architecture(arch: str, field: Callable[[str, Any], Any]) -> str:
    return "MixtralForCausalLM" if variant(arch, field) == "mixtral" else ARCHITECTURES[arch]


def hf_name(kind: str, gguf_name: str) -> str | None:
    """The Hugging Face name of a tensor (None: a tensor nanoplug does not load); an expert tensor's name
    holds "{e}" where its expert goes."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        part = BLOCK[kind].get(parts[2]) or EXPERTS.get(kind, {}).get(parts[2])
        return None if part is None else f"model.layers.{parts[1]}.{part}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[1].isdigit() and parts[3].isdigit() and parts[4] == "weight":
        # blk.L.ffn_gate.E: one expert's tensor, as converters before merged experts wrote Mixtral (llama.cpp
        # still reads them)
        part = EXPERTS.get(kind, {}).get(f"{parts[2]}_exps")
        return None if part is None else f"model.layers.{parts[1]}.{part.format(e=parts[3])}.weight"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _SKIPPED or base not in GLOBAL:
        return None
    return f"{GLOBAL[base]}.{suffix}"


def is_norm(gguf_name: str) -> bool:
    return gguf_name.rpartition(".")[0].split(".")[-1].endswith("norm")


# ------------------------------------------------------------------------------------------- the config
def _rope(arch: str, field: Callable[[str, Any], Any], base: float) -> dict:
    """The rope of the full-attention layers, as the converter writes it (rope.scaling.type and factor)."""
    kind = field(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return {"rope_type": "default", "rope_theta": base}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": base, "factor": float(field(f"{arch}.rope.scaling.factor"))}
    raise ModelLoadError(f"a {arch} GGUF with rope scaling {kind!r} is not read yet (none and linear are)")


def hf_config(arch: str, field: Callable[[str, Any], Any], tensors: dict[str, tuple[int, ...]]) -> Any:
    """The transformers config of a GGUF of `arch` (not in TRANSFORMERS_CONFIG, or a Mixtral), built from its
    metadata and tensor shapes (torch order) the way llama.cpp reads them."""
    import transformers

    kind = variant(arch, field)
    n_layers = int(field(f"{arch}.block_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    head_dim = int(field(f"{arch}.attention.key_length", 0) or field(f"{arch}.rope.dimension_count", 0)
                   or hidden // heads)
    if int(field(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"a {arch} GGUF whose keys and values differ in size is not served")
    rope_dims = int(field(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"a {arch} GGUF rotating {rope_dims} of {head_dim} features (partial rotary) is not "
                             "served")
    base = float(field(f"{arch}.rope.freq_base", 10000.0))
    cfg: dict[str, Any] = dict(
        vocab_size=tensors["token_embd.weight"][0], hidden_size=hidden, num_hidden_layers=n_layers,
        intermediate_size=int(field(f"{arch}.feed_forward_length")), num_attention_heads=heads,
        num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        max_position_embeddings=int(field(f"{arch}.context_length")),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),  # (its float32 rounding: gguf_file)
        tie_word_embeddings="output.weight" not in tensors, rope_parameters=_rope(arch, field, base),
        bos_token_id=field("tokenizer.ggml.bos_token_id", -1), eos_token_id=field("tokenizer.ggml.eos_token_id", -1),
        pad_token_id=field("tokenizer.ggml.padding_token_id", -1),
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[key] = None if cfg[key] == -1 else int(cfg[key])
    dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    window = int(field(f"{arch}.attention.sliding_window", 0) or 0)
    if kind == "mixtral":
        if dense:
            raise ModelLoadError(f"a Mixtral GGUF (llama with experts) whose layers {dense} have no router is not "
                                 "served: every Mixtral layer is sparse")
        cfg.update(num_local_experts=int(field("llama.expert_count")),
                   num_experts_per_tok=int(field("llama.expert_used_count")),
                   intermediate_size=int(field("llama.expert_feed_forward_length", cfg["intermediate_size"])),
                   sliding_window=None)
        return transformers.MixtralConfig(**cfg)
    if kind in ("qwen2moe", "qwen3moe"):
        # llama.cpp renormalises the top-k weights of qwen3moe and not of qwen2moe (its norm_w), whatever the
        # original config said; a layer without a router is a dense MLP (mlp_only_layers)
        # the experts' sizes: the metadata's, else their tensors' (older files lack the keys; llama.cpp's
        # fallbacks, n_ff / n_expert_used and n_ff, are what those converters wrote the tensors with)
        sparse = next((i for i in range(n_layers) if i not in dense), None)
        if sparse is None:
            raise ModelLoadError(f"this {arch} GGUF has no layer with experts (no ffn_gate_inp router)")
        exps = tensors.get(f"blk.{sparse}.ffn_gate_exps.weight", (0, 0))
        cfg.update(num_experts=int(field(f"{arch}.expert_count")), num_experts_per_tok=int(field(f"{arch}.expert_used_count")),
                   moe_intermediate_size=int(field(f"{arch}.expert_feed_forward_length", 0) or exps[1]),
                   norm_topk_prob=kind == "qwen3moe", decoder_sparse_step=1, mlp_only_layers=dense,
                   use_sliding_window=False)
        if kind == "qwen2moe":
            shexp = tensors.get(f"blk.{sparse}.ffn_gate_shexp.weight", (0,))
            cfg.update(shared_expert_intermediate_size=int(field("qwen2moe.expert_shared_feed_forward_length", 0)
                                                           or shexp[0]),
                       qkv_bias="blk.0.attn_q.bias" in tensors)
            return transformers.Qwen2MoeConfig(**cfg)
        return transformers.Qwen3MoeConfig(**cfg)
    if kind == "phi3":
        if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
            raise ModelLoadError("a Phi-3 GGUF with long-context rope factors (longrope) is not served")
        # llama.cpp turns Phi-3's window off (ggml-org/llama.cpp#13676); transformers, the reference, slides
        cfg.update(sliding_window=window or None, original_max_position_embeddings=int(
            field("phi3.rope.scaling.original_context_length", cfg["max_position_embeddings"])))
        return transformers.Phi3Config(**cfg)
    if kind in ("gemma2", "gemma3"):
        pattern = SWA_PATTERN[kind]
        scalar = hidden // heads if n_layers == _GEMMA_27B_LAYERS[kind] else head_dim
        layer_types = ["sliding_attention" if window and i % pattern < pattern - 1 else "full_attention"
                       for i in range(n_layers)]
        cfg.update(query_pre_attn_scalar=scalar, sliding_window=window or None, layer_types=layer_types,
                   final_logit_softcapping=float(field(f"{arch}.final_logit_softcapping", 0.0)) or None)
        if kind == "gemma2":
            cfg.update(attn_logit_softcapping=float(field("gemma2.attn_logit_softcapping", 0.0)) or None)
            return transformers.Gemma2Config(**cfg)
        local = {"rope_type": "default", "rope_theta": float(field("gemma3.rope.freq_base_swa", 10000.0))}
        cfg.update(rope_parameters={"full_attention": cfg["rope_parameters"], "sliding_attention": local})
        return transformers.Gemma3TextConfig(**cfg)
    raise ModelLoadError(f"no config builder for GGUF architecture {arch!r}")


def check_no_window(arch: str, field: Callable[[str, Any], Any]) -> None:
    """llama and qwen2 GGUFs run with full attention in llama.cpp (the converter writes no window for Mistral or
    Qwen2's use_sliding_window); a file that names one anyway says more than nanoplug can know how to honour."""
    window = field(f"{arch}.attention.sliding_window", None)
    if window:
        raise ModelLoadError(
            f"this {arch} GGUF names a sliding window of {window} tokens, which llama.cpp does not apply to {arch} "
            "and whose layers the file does not say; load the Hugging Face checkpoint instead")
