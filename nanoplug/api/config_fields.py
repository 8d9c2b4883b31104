"""Which fields of a Hugging Face config a model plugin honours, so that none is silently ignored.

A model that loads but computes something else than transformers would (an ignored field) is worse than a
refusal. Each model plugin names the fields it implements (`honoured`) and the fields it runs only at one
value (`fixed`); every other field must be one that does not change the computation (`INERT`), or the
plugin's `unavailable` refuses the checkpoint, naming the field. tests/test_config_fields.py walks every
model plugin's config class field by field.
"""
from __future__ import annotations

from typing import Any

# fields that do not change what the forward computes: bookkeeping, training-only settings, token ids (the
# engine reads eos from the generation config), and the shapes every plugin reads through ModelFacts
INERT = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "_name_or_path",
    "model_type", "output_attentions", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "attention_dropout", "resid_pdrop", "embd_pdrop", "quantization_config",
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
    # transformers' Llama no longer reads it (its slicing was numerically the same matmul)
    "pretraining_tp",
    # transformers' cache layout and generation defaults, and the generic fields older config.json files carry
    "cache_implementation", "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "torchscript", "pruned_heads",
    "return_dict_in_generate", "output_scores", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss", "use_bfloat16", "auto_map",
    "_attn_implementation_autoset", "transformers.js_config",
})


def inert(name: str) -> bool:
    """A field that does not change the forward: INERT's, and every token id (unk_token_id, sep_token_id, ...,
    which GGUF files and older configs carry)."""
    return name in INERT or name.endswith(("_token_id", "_token_ids"))

# rope types whose frequencies are fixed tables (rope_inv_freq); "dynamic" and "longrope" change them with the
# sequence's length in transformers, which precomputed tables cannot follow
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})


def rope_reasons(params: Any) -> list[str]:
    """Why a `rope_parameters` dict (or one per layer type, as Gemma-3 has) cannot be served; empty if it can."""
    if not params:
        return []
    if all(isinstance(v, dict) for v in params.values()):  # one per layer type
        return [r for v in params.values() for r in rope_reasons(v)]
    reasons = []
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        reasons.append(f"rope_type {rope_type!r} is not served (its frequencies change with the sequence's length "
                       f"in transformers); served: {', '.join(sorted(STATIC_ROPE_TYPES))}")
    factor = params.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1.0):
        reasons.append(f"partial_rotary_factor {factor} (rotating part of each head) is not implemented")
    return reasons


def config_reasons(hf_config: Any, architecture: str, honoured: frozenset[str],
                   fixed: dict[str, Any]) -> list[str]:
    """Every field of `hf_config` that `architecture`'s plugin neither honours nor needs (INERT), nor holds at
    the one value it runs (`fixed`), as a refusal naming it."""
    reasons = []
    for name, value in hf_config.to_dict().items():
        if inert(name) or name in honoured:
            continue
        if name in fixed:
            if value != fixed[name]:
                reasons.append(f"config field {name}={value!r}: {architecture} runs only {name}={fixed[name]!r}")
            continue
        reasons.append(f"config field {name}={value!r} is not implemented by {architecture}'s plugin (it would "
                       "compute something else than transformers)")
    if "rope_parameters" in honoured or "rope_scaling" in honoured:
        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
        reasons += rope_reasons(params)
        if getattr(hf_config, "partial_rotary_factor", None) not in (None, 1.0):
            reasons.append(f"partial_rotary_factor {hf_config.partial_rotary_factor} is not implemented")
    return reasons
