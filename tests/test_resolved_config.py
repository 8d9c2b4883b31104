"""transformers' config kept after its first load (checkpoint/resolved_config.py): a later load of the same
config.json rebuilds it without the architecture's config class, and reads the same as transformers' own on
every field, rope tables and tokens included; an edited config.json or a damaged kept file is loaded afresh."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (AutoConfig, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

from nanoplug.api.layers.rotary import rope_inv_freq
from nanoplug.checkpoint import resolved_config
from nanoplug.checkpoint.loader import load_hf_config

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=128, eos_token_id=1, pad_token_id=None, bos_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "llama3-rope": lambda: LlamaConfig(**SMALL, rope_scaling=LLAMA3_ROPE),
    "qwen3": lambda: Qwen3Config(**SMALL),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=32),
    "gemma3": lambda: Gemma3TextConfig(**SMALL),
    "phi3": lambda: Phi3Config(**SMALL),
    "qwen3-moe": lambda: Qwen3MoeConfig(**SMALL),
    "mixtral": lambda: MixtralConfig(**SMALL),
    "qwen2-moe": lambda: Qwen2MoeConfig(**SMALL),
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_second_load_is_rebuilt_and_reads_as_transformers_own(name, tmp_path):
    folder = tmp_path / name
    CONFIGS[name]().save_pretrained(folder)
    first = load_hf_config(folder)
    assert type(first).__module__.startswith("transformers.")  # the first load is transformers' own, then kept
    second = load_hf_config(folder)
    assert type(second).__module__ == resolved_config.__name__ and type(second).__name__ == type(first).__name__
    assert second.to_dict() == first.to_dict()
    assert resolved_config._readings(second) == resolved_config._readings(first)  # every field, aliases included
    again = pickle.loads(pickle.dumps(second))  # as a tensor-parallel rank is sent it
    assert type(again).__name__ == type(first).__name__ and resolved_config._readings(again) == resolved_config._readings(first)
    head_dim = first.hidden_size // first.num_attention_heads
    for a, b in zip(rope_inv_freq(second, head_dim), rope_inv_freq(first, head_dim)):  # transformers' rope helpers
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))  # call methods on it (standardize_rope_params)


def test_an_edited_config_is_loaded_afresh_and_a_damaged_kept_file_ignored(tmp_path):
    folder = tmp_path / "llama"
    LlamaConfig(**SMALL).save_pretrained(folder)
    load_hf_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-3
    (folder / "config.json").write_text(json.dumps(raw))
    edited = load_hf_config(folder)
    assert edited.rms_norm_eps == 1e-3 and type(edited).__module__.startswith("transformers.")
    kept = next((tmp_path / "cache" / "configs").glob("*.json"))
    for path in (tmp_path / "cache" / "configs").glob("*.json"):
        path.write_text("{not json")
    again = load_hf_config(folder)
    assert again.rms_norm_eps == 1e-3 and type(again).__module__.startswith("transformers.")
    assert json.loads(kept.read_text())  # written again, whole


def test_a_config_it_cannot_copy_is_not_kept(tmp_path):
    folder = tmp_path / "llama"
    LlamaConfig(**SMALL).save_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    config.custom = object()  # no JSON form: the rebuilt config would lack it
    assert resolved_config.keep((folder / "config.json").read_bytes(), config) is False
    assert not (tmp_path / "cache" / "configs").exists()


def test_a_warm_start_imports_no_config_class_and_tokenizes_alike(qwen3_dir, tmp_path):
    """The point of it: the config class's import (Llama's type validators pull torch.distributed.tensor in) is
    not paid, neither for the config nor for the tokenizer, which is handed the config loaded already."""
    code = ("import sys, json; from pathlib import Path; from nanoplug.checkpoint.loader import load_hf_config; "
            "from nanoplug.engine.tokenizer import load_tokenizer; "
            f"folder = Path({str(qwen3_dir)!r}); cfg = load_hf_config(folder); tok = load_tokenizer(folder, cfg); "
            "print(json.dumps([type(cfg).__module__, 'transformers.models.qwen3.configuration_qwen3' in sys.modules, "
            "tok('The capital of France is').input_ids, tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], "
            "tokenize=False)]))")
    env = {**os.environ, "NANOPLUG_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                      check=True, timeout=300).stdout) for _ in range(2)]
    assert runs[0][:2] == ["transformers.models.qwen3.configuration_qwen3", True]
    assert runs[1][:2] == [resolved_config.__name__, False]
    assert runs[1][2:] == runs[0][2:]
