"""The safetensors loader: single-file and sharded checkpoints, packed q/k/v and gate/up, tied
embeddings, dtype conversion, and errors that name the path or the supported architectures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _checkpoints import checkpoint, hf_model, prompt_ids, scratch_dir
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.errors import ModelLoadError

OPTIONS = dict(kv_block_size=16, attention="manual", kv_cache="torch", num_kv_blocks=32, max_model_len=128)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def loaded_model(llm: LLM) -> torch.nn.Module:
    return llm.engine.worker.model


def copy_with(folder: Path, source: str, skip: tuple[str, ...] = ()) -> Path:
    """Link every file of `source` into `folder` except `skip`."""
    for item in Path(source).iterdir():
        if item.name not in skip:
            (folder / item.name).symlink_to(item)
    return folder


# ----------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("name", ["qwen3", "qwen2", "qwen2_tied"])
def test_packed_projections_hold_the_checkpoint_tensors(name):
    hf = hf_model(name).state_dict()
    with LLM(checkpoint(name), **OPTIONS) as llm:
        model = loaded_model(llm)
        params = dict(model.named_parameters())
        layers = model.model.layers
        for i, layer in enumerate(layers):
            prefix = f"model.layers.{i}."
            qkv = torch.cat([hf[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
            assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
            if name.startswith("qwen2"):  # q/k/v bias, packed the same way
                bias = torch.cat([hf[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"])
                assert torch.equal(layer.self_attn.qkv_proj.bias, bias)
            gate_up = torch.cat([hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"]])
            assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
            assert torch.equal(layer.mlp.down_proj.weight, hf[prefix + "mlp.down_proj.weight"])
            assert torch.equal(layer.self_attn.o_proj.weight, hf[prefix + "self_attn.o_proj.weight"])
        assert torch.equal(params["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
        assert torch.equal(params["model.norm.weight"], hf["model.norm.weight"])


def test_tied_embeddings_share_one_tensor_and_untied_do_not():
    with LLM(checkpoint("qwen3_tied"), **OPTIONS) as tied:
        model = loaded_model(tied)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with LLM(checkpoint("qwen3"), **OPTIONS) as untied:
        model = loaded_model(untied)
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        assert torch.equal(model.lm_head.weight, hf_model("qwen3").lm_head.weight)
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_sharded_checkpoint_with_index_loads_the_same_model():
    folder = scratch_dir("sharded")
    hf_model("qwen3").save_pretrained(str(folder), max_shard_size="4MB")
    copy_with(folder, checkpoint("qwen3"), skip=("config.json", "generation_config.json", "model.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_logits=True)
    with LLM(str(folder), **OPTIONS) as sharded, LLM(checkpoint("qwen3"), **OPTIONS) as single:
        for (name, a), (_, b) in zip(loaded_model(sharded).named_parameters(), loaded_model(single).named_parameters()):
            assert torch.equal(a, b), name
        a = sharded.generate(prompt_ids(), params, use_tqdm=False)
        b = single.generate(prompt_ids(), params, use_tqdm=False)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert all(torch.equal(torch.stack(x.logits), torch.stack(y.logits)) for x, y in zip(a, b))


def test_dtype_is_converted_on_load():
    bf16 = write_random_checkpoint(scratch_dir("bf16") / "ckpt", "Qwen3ForCausalLM", seed=5, dtype=torch.bfloat16)
    from safetensors.torch import load_file

    saved = load_file(str(bf16 / "model.safetensors"))
    assert saved["model.embed_tokens.weight"].dtype == torch.bfloat16
    with LLM(str(bf16), **OPTIONS, dtype="float32") as up:
        model = loaded_model(up)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"].float())
        assert up.generate(prompt_ids()[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].token_ids
    with LLM(checkpoint("qwen3"), **OPTIONS, dtype="bfloat16") as down:
        model = loaded_model(down)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        want = hf_model("qwen3").model.layers[0].mlp.down_proj.weight.to(torch.bfloat16)
        assert torch.equal(model.model.layers[0].mlp.down_proj.weight, want)
        out = down.generate(prompt_ids()[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert len(out[0].token_ids) == 2


# ------------------------------------------------------------------------------------ errors
def test_missing_folder_names_the_path():
    missing = str(scratch_dir("parent_of_missing") / "no_such_model")
    with pytest.raises(ModelLoadError, match=f"model folder '{missing}' does not exist"):
        LLM(missing, **OPTIONS)


def test_folder_without_config_names_the_file():
    folder = copy_with(scratch_dir("no_config"), checkpoint(), skip=("config.json",))
    with pytest.raises(ModelLoadError, match=f"'{folder / 'config.json'}' is missing"):
        LLM(str(folder), **OPTIONS)


def test_folder_without_weights_names_the_folder():
    folder = copy_with(scratch_dir("no_weights"), checkpoint(), skip=("model.safetensors",))
    with pytest.raises(ModelLoadError, match=f"no \\*.safetensors file in '{folder}'"):
        LLM(str(folder), **OPTIONS)


def test_index_naming_a_missing_shard_names_it():
    folder = scratch_dir("missing_shard")
    hf_model("qwen3").save_pretrained(str(folder), max_shard_size="4MB")
    copy_with(folder, checkpoint("qwen3"), skip=("config.json", "generation_config.json", "model.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (folder / gone).unlink()
    with pytest.raises(ModelLoadError, match=f"names shard files that are missing: {gone}"):
        LLM(str(folder), **OPTIONS)


def test_checkpoint_lacking_a_weight_names_it():
    from safetensors.torch import load_file, save_file

    folder = copy_with(scratch_dir("lacking_weight"), checkpoint(), skip=("model.safetensors",))
    tensors = load_file(str(Path(checkpoint()) / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks 1 weights the model needs, e.g. model.layers.1.mlp.down_proj.weight"):
        LLM(str(folder), **OPTIONS)


@pytest.mark.parametrize("config", [
    {"architectures": ["FooForCausalLM"], "model_type": "foo"},  # unknown to transformers too
    {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32},
])
def test_unsupported_architecture_lists_the_supported_ones(config):
    folder = copy_with(scratch_dir(f"arch_{config['model_type']}"), checkpoint(), skip=("config.json",))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        LLM(str(folder), **OPTIONS)
    message = str(err.value)
    assert f"architecture {config['architectures'][0]!r}" in message and str(folder) in message
    for supported in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"):
        assert supported in message
