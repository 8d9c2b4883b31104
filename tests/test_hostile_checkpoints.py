"""Checkpoints a skeptical user (or a damaged download) hands the loader (issue 13, items 2, 5 and 7).

Each case is a tiny random checkpoint, corrupted one way: tensors whose shapes the config does not
build, tensors the model has no place for, a malformed config.json, damaged safetensors, a malformed
shard index, or one that points outside the model folder. Every one must stop the load with a
ModelLoadError naming the tensor or file and the fix, never load quietly and give wrong tokens.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from _checkpoints import checkpoint, scratch_dir
from nanoplug import LLM, SamplingParams
from nanoplug.errors import ModelLoadError, WeightShapeError
from nanoplug.checkpoint.loader import copy_weight, load_hf_config

OPTIONS = dict(kv_block_size=16, attention="manual", kv_cache="torch", num_kv_blocks=32, max_model_len=128)
Tensors = dict[str, torch.Tensor]


def damaged(name: str, base: str = "qwen3", tensors: Callable[[Tensors], None] | None = None,
            config: Callable[[dict], object] | None = None) -> Path:
    """A copy of checkpoint `base` whose tensors and/or config.json were changed in place by the given edits."""
    folder = scratch_dir(name)
    source = Path(checkpoint(base))
    for item in source.iterdir():
        if not (tensors and item.name == "model.safetensors") and not (config and item.name == "config.json"):
            (folder / item.name).symlink_to(item)
    if tensors:
        saved = load_file(str(source / "model.safetensors"))
        tensors(saved)
        save_file(saved, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if config:
        settings = json.loads((source / "config.json").read_text())
        edited = config(settings)
        (folder / "config.json").write_text(edited if isinstance(edited, str) else json.dumps(settings))
    return folder


def load_error(folder: Path, error: type[Exception] = ModelLoadError) -> str:
    with pytest.raises(error) as err:
        LLM(str(folder), **OPTIONS)
    return str(err.value)


def greedy(folder: Path | str) -> list[int]:
    with LLM(str(folder), **OPTIONS) as llm:
        return llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].token_ids


# ------------------------------------------------------------------------- item 2: shapes
def _down_proj_one_row(t: Tensors) -> None:
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:1].clone()


def _norm_of_size_one(t: Tensors) -> None:
    t["model.norm.weight"] = t["model.norm.weight"][:1].clone()


def _q_proj_twice_the_rows(t: Tensors) -> None:
    q = t["model.layers.1.self_attn.q_proj.weight"]
    t["model.layers.1.self_attn.q_proj.weight"] = torch.cat([q, q])


def _gate_proj_transposed(t: Tensors) -> None:
    t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"].t().contiguous()


def _o_proj_wider(t: Tensors) -> None:
    o = t["model.layers.0.self_attn.o_proj.weight"]
    t["model.layers.0.self_attn.o_proj.weight"] = torch.cat([o, o], dim=1)


@pytest.mark.parametrize("edit, tensor, found, expected", [
    (_down_proj_one_row, "model.layers.0.mlp.down_proj.weight", [1, 128], [64, 128]),  # copy_ would broadcast it
    (_norm_of_size_one, "model.norm.weight", [1], [64]),  # copy_ would broadcast it
    (_q_proj_twice_the_rows, "model.layers.1.self_attn.q_proj.weight", [128, 64], [64, 64]),  # narrow would cut it
    (_gate_proj_transposed, "model.layers.0.mlp.gate_proj.weight", [64, 128], [128, 64]),
    (_o_proj_wider, "model.layers.0.self_attn.o_proj.weight", [64, 128], [64, 64]),
])
def test_a_tensor_of_the_wrong_shape_names_tensor_file_and_both_shapes(edit, tensor, found, expected):
    folder = damaged(f"shape_{edit.__name__}", tensors=edit)
    message = load_error(folder, WeightShapeError)
    assert f"checkpoint tensor {tensor!r} in {str(folder / 'model.safetensors')!r}" in message
    assert f"has shape {found}, but the model expects {expected}" in message
    assert "config.json does not describe these weights" in message


def test_a_config_vocab_size_smaller_than_the_embedding_rows_is_caught():
    rows = load_file(str(Path(checkpoint("qwen3_tied")) / "model.safetensors"))["model.embed_tokens.weight"].shape[0]

    def smaller_vocab(settings: dict) -> None:
        settings["vocab_size"] = rows - 7

    message = load_error(damaged("vocab_smaller", base="qwen3_tied", config=smaller_vocab), WeightShapeError)
    assert "'model.embed_tokens.weight'" in message
    assert f"has shape [{rows}, 64], but the model expects [{rows - 7}, 64] (vocab_size x hidden_size" in message


def test_an_integer_tensor_is_not_converted_into_weights():
    def quantized(t: Tensors) -> None:
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.int8)

    message = load_error(damaged("int8_tensor", tensors=quantized))
    assert "'model.layers.0.mlp.up_proj.weight'" in message and "int8 values" in message


def test_a_fused_layer_lacking_one_of_its_parts_names_the_part():
    def no_k(t: Tensors) -> None:
        del t["model.layers.1.self_attn.k_proj.weight"]

    message = load_error(damaged("no_k_proj", tensors=no_k))
    assert "lacks 1 weights the model needs, e.g. model.layers.1.self_attn.k_proj.weight" in message


# ------------------------------------------------------------------ item 2: unexpected tensors
def test_tensors_of_layers_beyond_the_config_are_an_error():
    def third_layer(t: Tensors) -> None:
        for name in [n for n in t if n.startswith("model.layers.1.")]:
            t[name.replace("layers.1.", "layers.2.")] = t[name].clone()

    message = load_error(damaged("extra_layer", tensors=third_layer))
    assert "holds 11 tensor(s) this model has no parameter for" in message
    assert "model.layers.2." in message and "(model.safetensors)" in message
    assert "another architecture, or config.json does not describe them" in message


def test_a_bias_the_config_switches_off_is_an_error():
    def with_bias(t: Tensors) -> None:
        t["model.layers.0.self_attn.q_proj.bias"] = torch.ones(64)

    message = load_error(damaged("stray_bias", tensors=with_bias))
    assert "model.layers.0.self_attn.q_proj.bias (model.safetensors)" in message


def test_tensors_of_modules_the_model_lacks_are_named_in_a_warning(caplog):
    def extra_head(t: Tensors) -> None:
        t["mtp.proj.weight"] = torch.ones(4, 4)
        t["value_head.weight"] = torch.ones(1, 64)

    folder = damaged("extra_head", tensors=extra_head)
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        assert greedy(folder) == greedy(checkpoint("qwen3"))
    (record,) = [r for r in caplog.records if "does not use" in r.getMessage()]
    assert "holds 2 tensor(s)" in record.getMessage()
    assert "mtp.proj.weight (model.safetensors)" in record.getMessage() and "value_head.weight" in record.getMessage()


def test_known_harmless_extras_load_without_a_word(caplog):
    def harmless(t: Tensors) -> None:
        for i in range(2):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()  # tied: the embeddings serve as the head

    folder = damaged("harmless", base="qwen3_tied", tensors=harmless)
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        assert greedy(folder) == greedy(checkpoint("qwen3_tied"))
    assert not [r for r in caplog.records if "tensor" in r.getMessage()]


# ------------------------------------------------------------ item 2: the layers' own loaders
class _Rank:
    """One rank of a group that never communicates: enough to build and load that rank's shard."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.local_rank = rank, world_size, rank

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x

    def layers(self):
        from nanoplug.api import Layers

        return Layers(self)


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_layer_loader_refuses_a_tensor_it_would_cut_or_broadcast(world_size):
    layers = _Rank(world_size - 1, world_size).layers()
    column, row = layers.column(8, 12, bias=True), layers.row(12, 8, bias=True)
    merged, qkv = layers.merged_column(8, [12, 12]), layers.qkv(8, 2, 4, 2, bias=True)
    embedding, head = layers.embedding(10, 8), layers.lm_head(10, 8)
    cases = [
        (column.weight_loader, column.weight, torch.ones(13, 8), None),  # rows that do not split over 2 ranks
        (column.weight_loader, column.weight, torch.ones(1, 8), None),  # would broadcast on one rank
        (column.weight_loader, column.bias, torch.ones(24), None),
        (row.weight_loader, row.weight, torch.ones(8, 13), None),
        (row.weight_loader, row.bias, torch.ones(1), None),  # would broadcast
        (merged.weight_loader, merged.weight, torch.ones(24, 8), 0),  # gate with the up rows too
        (merged.weight_loader, merged.weight, torch.ones(12, 9), 1),
        (qkv.weight_loader, qkv.weight, torch.ones(16, 8), "q"),  # twice the q rows
        (qkv.weight_loader, qkv.weight, torch.ones(8, 8), "k"),
        (qkv.weight_loader, qkv.bias, torch.ones(2), "v"),
        (embedding.weight_loader, embedding.weight, torch.ones(12, 8), None),  # more rows than vocab_size
        (head.weight_loader, head.weight, torch.ones(9, 8), None),
    ]
    for loader, param, tensor, shard in cases:
        param.data.zero_()
        with pytest.raises(WeightShapeError, match=re.escape(f"a tensor of shape {list(tensor.shape)}, but the model expects")):
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
        assert not param.detach().any()  # refused before anything was written


def test_an_already_fused_tensor_is_not_split_over_ranks():
    qkv = _Rank(0, 2).layers().qkv(8, 2, 4, 2)
    with pytest.raises(ModelLoadError, match="already fused QKVParallelLinear tensor cannot be split over 2 ranks"):
        qkv.weight_loader(qkv.weight, torch.ones(16, 8))
    single = _Rank(0, 1).layers().qkv(8, 2, 4, 2)
    single.weight_loader(single.weight, torch.arange(128.0).view(16, 8))  # one rank: the fused tensor is whole
    assert torch.equal(single.weight, torch.arange(128.0).view(16, 8))


def test_copy_weight_never_broadcasts():
    with pytest.raises(WeightShapeError, match=r"a tensor of shape \[1, 4\], but the model expects \[3, 4\]"):
        copy_weight(torch.zeros(3, 4), torch.ones(1, 4))


# ---------------------------------------------------------------------- item 5: config.json
@pytest.mark.parametrize("name, text, expected", [
    ("truncated", lambda s: json.dumps(s)[:-20], "is not valid JSON"),
    ("list", lambda s: json.dumps([s]), "holds a JSON list, not an object of settings"),
    ("string", lambda s: json.dumps("Qwen3ForCausalLM"), "holds a JSON string, not an object of settings"),
    ("empty", lambda s: "", "is not valid JSON"),
    ("architectures_str", lambda s: json.dumps({**s, "architectures": "Qwen3ForCausalLM"}),
     "'architectures' must be a list of class names"),
    ("model_type_list", lambda s: json.dumps({**s, "model_type": ["qwen3"]}), "model_type must be a string"),
    ("hidden_list", lambda s: json.dumps({**s, "hidden_size": [64]}), "hidden_size must be a positive integer, found [64]"),
    ("layers_str", lambda s: json.dumps({**s, "num_hidden_layers": "2"}),
     "num_hidden_layers must be a positive integer, found '2'"),
    ("heads_bool", lambda s: json.dumps({**s, "num_attention_heads": True}),
     "num_attention_heads must be a positive integer, found True"),
    ("vocab_zero", lambda s: json.dumps({**s, "vocab_size": 0}), "vocab_size must be a positive integer, found 0"),
])
def test_a_malformed_config_json_names_the_file_and_the_fix(name, text, expected):
    folder = damaged(f"config_{name}", config=text)
    for attempt in (lambda: load_hf_config(folder), lambda: LLM(str(folder), **OPTIONS)):
        with pytest.raises(ModelLoadError) as err:
            attempt()
        message = str(err.value)
        assert message.startswith(repr(str(folder / "config.json"))) and expected in message
        assert "config.save_pretrained(folder)" in message


def test_a_config_json_that_is_not_utf8_names_the_file():
    folder = damaged("config_latin1", config=lambda s: "{}")
    (folder / "config.json").write_bytes(b'{"architectures": ["Qw\xe9n3ForCausalLM"]}')
    with pytest.raises(ModelLoadError, match=re.escape(f"{str(folder / 'config.json')!r} is not UTF-8 text")):
        load_hf_config(folder)


# ------------------------------------------------------------------------ item 5: safetensors
def _bytes_of(base: str = "qwen3") -> bytes:
    return (Path(checkpoint(base)) / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name, content", [
    ("truncated", lambda: _bytes_of()[: len(_bytes_of()) // 2]),  # an interrupted download
    ("header_only", lambda: _bytes_of()[:20]),
    ("garbage", lambda: os.urandom(4096)),
    ("empty", lambda: b""),
    ("html", lambda: b"<!DOCTYPE html><html><body>Repository not found</body></html>"),
])
def test_a_damaged_safetensors_file_names_the_file_and_the_fix(name, content):
    folder = damaged(f"weights_{name}", tensors=lambda t: None)
    (folder / "model.safetensors").write_bytes(content())
    message = load_error(folder)
    assert message.startswith(f"{str(folder / 'model.safetensors')!r} is not a readable safetensors file")
    assert "download or save the checkpoint again" in message


# ---------------------------------------------------------------------- item 5: shard index
def sharded(name: str, edit: Callable[[dict, Path], object] | None = None) -> Path:
    """Checkpoint qwen3 split into shards with an index, the index then changed by `edit(index, folder)`."""
    folder = scratch_dir(name)
    tensors = load_file(str(Path(checkpoint("qwen3")) / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    for item in Path(checkpoint("qwen3")).iterdir():
        if item.name != "model.safetensors":
            (folder / item.name).symlink_to(item)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    edited = edit(index, folder) if edit else None
    (folder / "model.safetensors.index.json").write_text(edited if isinstance(edited, str) else json.dumps(index))
    return folder


def test_an_intact_sharded_checkpoint_loads_the_same_model():
    assert greedy(sharded("shards_intact")) == greedy(checkpoint("qwen3"))


@pytest.mark.parametrize("name, edit, expected", [
    ("truncated", lambda index, folder: json.dumps(index)[:50], "is not valid JSON"),
    ("list", lambda index, folder: json.dumps([index]), "has no 'weight_map' object"),
    ("no_map", lambda index, folder: json.dumps({"metadata": {}}), "has no 'weight_map' object"),
    ("map_list", lambda index, folder: json.dumps({"weight_map": list(index["weight_map"])}),
     "has no 'weight_map' object"),
    ("value_int", lambda index, folder: index["weight_map"].update({"model.norm.weight": 3}),
     "weight_map values must name shard files, found 'model.norm.weight': 3"),
])
def test_a_malformed_shard_index_names_the_file_and_the_fix(name, edit, expected):
    folder = sharded(f"index_{name}", edit)
    message = load_error(folder)
    assert message.startswith(repr(str(folder / "model.safetensors.index.json"))) and expected in message
    assert "save_pretrained" in message


# ----------------------------------------------------------- item 7: shards outside the folder
def _outside_file(folder: Path) -> Path:
    """A file outside the model folder that must never be opened: reading it would fail differently."""
    outside = folder.parent / f"{folder.name}_outside.safetensors"
    outside.write_bytes(b"not safetensors: the loader must refuse before it reads this")
    return outside


def _point_norm_at(target: Callable[[Path], str]):
    def edit(index: dict, folder: Path) -> None:
        index["weight_map"]["model.norm.weight"] = target(folder)
    return edit


def _symlink_out(folder: Path) -> str:
    (folder / "model-extra.safetensors").symlink_to(_outside_file(folder))
    return "model-extra.safetensors"


@pytest.mark.parametrize("name, edit, why", [
    ("dotdot", _point_norm_at(lambda f: f"../{_outside_file(f).name}"), "a path outside the model folder"),
    ("deep_dotdot", _point_norm_at(lambda f: f"sub/../../../{_outside_file(f).name}"), "a path outside the model folder"),
    ("absolute", _point_norm_at(lambda f: str(_outside_file(f))), "a path outside the model folder"),
    ("symlink", _point_norm_at(_symlink_out), "a symlink leading out of the folder"),
])
def test_a_shard_index_pointing_outside_the_folder_is_refused_unread(name, edit, why, monkeypatch):
    folder = sharded(f"escape_{name}", edit)
    opened = []
    import nanoplug.checkpoint.loader as loader

    real_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda path, **kw: opened.append(path) or real_open(path, **kw))
    message = load_error(folder)
    assert message.startswith(repr(str(folder / "model.safetensors.index.json"))) and why in message
    assert "may only name files inside the model folder" in message
    assert opened == []  # refused before any shard was read


def test_a_hugging_face_cache_snapshot_whose_shards_link_into_its_blobs_loads(tmp_path):
    """The hub cache keeps files in models--org--name/blobs and links them from snapshots/REV: allowed."""
    source = sharded("cache_source")
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, item in enumerate(sorted(source.iterdir())):
        blob = blobs / f"blob{i}"
        blob.write_bytes(item.resolve().read_bytes())
        (snapshot / item.name).symlink_to(Path("../..") / "blobs" / blob.name)
    assert greedy(snapshot) == greedy(checkpoint("qwen3"))


# ------------------------------------------------------------ item 5: a LoRA adapter's files
def _lora_folder(name: str) -> Path:
    folder = scratch_dir(name)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    save_file({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.ones(2, 64),
               "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.ones(128, 2)},
              str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("file, content, expected", [
    ("adapter_config.json", b'{"peft_type": "LORA", "r": ', "is not valid JSON"),
    ("adapter_config.json", b'["LORA"]', "holds a JSON list, not an object of settings"),
    ("adapter_model.safetensors", b"\x00" * 3, "is not a readable safetensors file"),
])
def test_a_damaged_lora_folder_names_the_file(file, content, expected):
    from nanoplug.plugins.adapters.lora.peft_folder import read_peft_lora

    folder = _lora_folder(f"lora_{file}_{len(content)}")
    assert read_peft_lora(folder).modules  # intact, it reads
    (folder / file).write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        read_peft_lora(folder)
    assert str(err.value).startswith(repr(str(folder / file))) and expected in str(err.value)
    assert "save_pretrained" in str(err.value)
