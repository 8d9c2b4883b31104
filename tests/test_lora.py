"""The `lora` adapter plugin against PEFT on tiny random Qwen3 and Llama checkpoints (float32).

Merged at load, the engine's logits must be within 1e-4 (relative) of PEFT's `merge_and_unload()`
model in transformers and its greedy tokens equal that model's `generate`: all seven projection
types (q/k/v and gate/up packed by the engine), alpha/r and rsLoRA scaling, a user scale, two
adapters stacked, and under tensor parallelism. Per request (merge=False), each request's tokens
must equal those of an engine with its adapter merged, with several adapters and none in one batch,
chunked prefill and prefix-cache hits (here on the plain masked path; tests/test_lora_kernels.py runs the
same checks on the Triton kernels), and an engine whose adapters are not graph-safe decodes eager. Bad
adapters fail with errors that name the fix.
"""
from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _checkpoints import PROMPTS, prompt_ids, relative_error, scratch_dir
from _peft_loras import base, hf_base, peft_lora
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.errors import AdapterError, GraphCaptureError, ModelLoadError, RequestError

ENGINE = dict(kv_block_size=16, attention="manual", kv_cache="torch", num_kv_blocks=96, max_model_len=256)
STEPS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, output_logits=True)


# ------------------------------------------------------------------------------------ fixtures
@lru_cache(maxsize=None)
def peft_merged(arch: str, loras: tuple[tuple[str, float], ...]):
    """transformers' model with each PEFT adapter merged in turn by `merge_and_unload()`, at its scale."""
    import copy

    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = copy.deepcopy(hf_base(arch))
    for folder, scale in loras:
        model = PeftModel.from_pretrained(model, folder)
        for layer in model.modules():
            if isinstance(layer, LoraLayer):
                layer.set_scale("default", scale)
        model = model.merge_and_unload()
    return model.eval()


def engine(arch: str, **options) -> LLM:
    return LLM(base(arch), **{**ENGINE, **options})


def check_against_peft(llm: LLM, arch: str, loras: tuple[tuple[str, float], ...], prompts: list[list[int]]) -> None:
    """Logits of prefill and every decode step within 1e-4 of PEFT's merged model; greedy tokens equal."""
    reference = peft_merged(arch, loras)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        with torch.no_grad():
            want = reference(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1:]
            hf_tokens = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                           max_new_tokens=STEPS, do_sample=False, pad_token_id=0)[0, len(ids):]
        got = torch.stack(out.logits)
        assert got.shape == want.shape
        for step, (g, w) in enumerate(zip(got, want)):
            assert relative_error(g, w) < 1e-4, f"prompt of {len(ids)} tokens, step {step}"
        assert out.token_ids == hf_tokens.tolist()


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


# --------------------------------------------------------------------------------- merged
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_merged_lora_equals_peft_merge_and_unload(arch):
    lora = peft_lora(arch, seed=1)
    prompts = prompt_ids("qwen3")
    # a plain path string means a LoRA at scale 1.0; the dict form says the same
    llm = engine(arch, adapters=lora if arch == "qwen3" else [{"kind": "lora", "path": lora, "scale": 1.0}])
    check_against_peft(llm, arch, ((lora, 1.0),), prompts)
    plain = engine(arch).generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(plain) != tokens(llm.generate(prompts, GREEDY, use_tqdm=False)), "the adapter changed nothing"


def test_rslora_at_a_user_scale_equals_peft():
    lora = peft_lora("qwen3", seed=2, r=4, alpha=8, rslora=True)  # scaling alpha/sqrt(r) = 4, not alpha/r = 2
    assert json.loads((Path(lora) / "adapter_config.json").read_text())["use_rslora"] is True
    llm = engine("qwen3", adapters=[{"path": lora, "scale": 0.5}])
    check_against_peft(llm, "qwen3", ((lora, 0.5),), prompt_ids("qwen3"))


def test_two_stacked_adapters_equal_peft_merging_both_in_order():
    first, second = peft_lora("llama", seed=3), peft_lora("llama", seed=4, r=4, alpha=4)
    llm = engine("llama", adapters=[{"path": first, "scale": 1.0}, {"path": second, "scale": 1.5}])
    check_against_peft(llm, "llama", ((first, 1.0), (second, 1.5)), prompt_ids("qwen3"))


def test_tensor_parallel_shards_merged_and_per_request_adapters(monkeypatch):
    """Merging happens before sharding, and per-request A/B are sharded like the base weights."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the masked path (test_lora_kernels.py: the kernels)
    check_tensor_parallel_per_request()


def check_tensor_parallel_per_request() -> None:
    import nanoplug.plugins.parallel.tensor  # noqa: F401  (the strategy under test must exist)

    merged, per_request = peft_lora("qwen3", seed=1), peft_lora("qwen3", seed=5)
    prompts = prompt_ids("qwen3")[:2]
    with engine("qwen3", parallel="tensor", tensor_parallel_size=2,
                adapters=[merged, {"path": per_request, "name": "extra", "merge": False}]) as llm:
        outputs = llm.generate(prompts * 2, [GREEDY] * 2 + [GREEDY.model_copy(update={"adapter": "extra"})] * 2,
                               use_tqdm=False)
    want = engine("qwen3", adapters=[merged, per_request]).generate(prompts, GREEDY, use_tqdm=False)
    single = engine("qwen3", adapters=[merged]).generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outputs) == tokens(single) + tokens(want)
    for got, ref in zip(outputs, single + want):
        assert relative_error(torch.stack(got.logits), torch.stack(ref.logits)) < 1e-4


# ------------------------------------------------------------------------------ per request
def test_per_request_adapters_equal_engines_with_that_adapter_merged(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the masked path (test_lora_kernels.py: the kernels)
    llm = check_per_request_equals_merged()
    assert not llm.engine.worker.request_adapters.kernels


def check_per_request_equals_merged() -> LLM:
    """Every adapter and none in one batch, chunked prefill and prefix-cache hits: each request's tokens and
    logits those of an engine with its adapter merged. Returns the per-request engine."""
    one, two = peft_lora("qwen3", seed=1), peft_lora("qwen3", seed=6, r=4, alpha=8)
    story = prompt_ids("qwen3", [PROMPTS[2] * 2])[0]  # 3+ blocks: prefix-cache hits across requests
    prompts = prompt_ids("qwen3") + [story]
    choices = [None, "one", "two"]
    llm = engine("qwen3", max_num_batched_tokens=40,  # long prompts prefill in chunks, mixed with others
                 adapters=[{"path": one, "name": "one", "merge": False},
                           {"path": two, "name": "two", "scale": 0.5, "merge": False}])
    requests = [(ids, name) for ids in prompts for name in choices]  # every adapter and none in one batch
    params = [GREEDY.model_copy(update={"adapter": name}) for _, name in requests]
    first = llm.generate([ids for ids, _ in requests], params, use_tqdm=False)
    again = llm.generate([ids for ids, _ in requests], params, use_tqdm=False)  # now from the prefix cache
    assert any(o.num_cached_tokens for o in again)
    merged = {
        None: engine("qwen3").generate(prompts, GREEDY, use_tqdm=False),
        "one": engine("qwen3", adapters=[one]).generate(prompts, GREEDY, use_tqdm=False),
        "two": engine("qwen3", adapters=[{"path": two, "scale": 0.5}]).generate(prompts, GREEDY, use_tqdm=False),
    }
    for outputs in (first, again):
        for (ids, name), got in zip(requests, outputs):
            want = merged[name][prompts.index(ids)]
            assert got.token_ids == want.token_ids, f"adapter {name}, prompt of {len(ids)} tokens"
            assert relative_error(torch.stack(got.logits), torch.stack(want.logits)) < 1e-4
    assert len({tuple(merged[name][0].token_ids) for name in choices}) == 3, "the adapters must differ"
    return llm


def test_per_request_adapters_that_are_not_graph_safe_keep_decode_eager(monkeypatch):
    from _lora_layers import write_lora

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the masked path, which graphs would not serve
    path = write_random_checkpoint(scratch_dir("lora-head-64"), head_dim=64)  # a head size `cpu` attention takes
    config = json.loads((path / "config.json").read_text())
    lora = {"path": write_lora(scratch_dir("lora-head-64-adapter"), config, seed=1), "merge": False}
    options = dict(ENGINE, attention="cpu", cpu={"graphs": True})  # a backend the CPU graphs record
    llm = LLM(str(path), adapters=[lora], **options)
    assert not llm.engine.worker.request_adapters.graph_safe and llm.engine.worker.graphs is None
    with pytest.raises(GraphCaptureError, match="graph_safe is False.*merge=True"):
        LLM(str(path), adapters=[lora], **{**options, "cpu": {"graphs": True, "require_graphs": True}})


def test_unknown_request_adapter_names_the_loaded_ones_and_costs_no_other_request():
    llm = engine("qwen3", adapters=[{"path": peft_lora("qwen3", seed=1), "name": "one", "merge": False}])
    prompts = prompt_ids("qwen3")[:2]
    with pytest.raises(RequestError, match=r"'nope'.*'one'"):
        llm.generate(prompts, [GREEDY.model_copy(update={"adapter": "one"}), GREEDY.model_copy(update={"adapter": "nope"})],
                     use_tqdm=False)
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
    assert len(llm.generate(prompts, GREEDY.model_copy(update={"adapter": "one"}), use_tqdm=False)) == 2
    with pytest.raises(RequestError, match="none"):
        engine("qwen3").generate(prompts, GREEDY.model_copy(update={"adapter": "one"}), use_tqdm=False)


def test_per_request_names_must_be_distinct():
    lora = peft_lora("qwen3", seed=1)
    with pytest.raises(ValueError, match="distinct name"):
        engine("qwen3", adapters=[{"path": lora, "merge": False}, {"path": lora, "merge": False}])


# ----------------------------------------------------------------------------------- errors
def edited_copy(source: str, name: str, config: dict | None = None, edit_tensors=None) -> str:
    """A copy of a PEFT adapter folder with its config updated and its tensors edited."""
    folder = scratch_dir(name)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    cfg_file = folder / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **(config or {})}))
    if edit_tensors is not None:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        save_file(edit_tensors(tensors), str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_adapter_of_another_architecture_is_refused():
    with pytest.raises(AdapterError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM.*base model"):
        engine("qwen3", adapters=[peft_lora("llama", seed=1)])  # PEFT recorded the base model's class
    unrecorded = edited_copy(peft_lora("llama", seed=1), "lora-llama-unrecorded", {"auto_mapping": None})
    with pytest.raises(AdapterError, match=r"architecture LlamaForCausalLM vs Qwen3ForCausalLM"):
        engine("qwen3", adapters=[unrecorded])  # the base folder named in the config is read instead


def test_adapter_of_other_shapes_is_refused():
    def narrower(tensors):
        return {k: v[:-8] if "layers.1.mlp.up_proj.lora_B" in k else v for k, v in tensors.items()}

    other = edited_copy(peft_lora("qwen3", seed=1), "lora-other-shapes",
                        {"auto_mapping": None, "base_model_name_or_path": "someone/another-model"}, narrower)
    with pytest.raises(AdapterError, match=r"up_proj.weight is \[128, 64\] here.*\[120, 64\].*'someone/another-model'"):
        engine("qwen3", adapters=[other])
    with pytest.raises(AdapterError, match="does not fit"):
        engine("qwen3", adapters=[{"path": other, "merge": False}])


def test_target_module_the_model_lacks_is_refused():
    def extra_layer(tensors):
        extra = {k.replace("layers.1.", "layers.7."): v.clone() for k, v in tensors.items() if "layers.1.self_attn.q_proj" in k}
        return {**tensors, **extra}

    lora = edited_copy(peft_lora("qwen3", seed=1), "lora-extra-layer", edit_tensors=extra_layer)
    with pytest.raises(AdapterError, match=r"lacks, e\.g\. model\.layers\.7\.self_attn\.q_proj"):
        engine("qwen3", adapters=[lora])


@pytest.mark.parametrize("config, what", [
    ({"peft_type": "IA3"}, "IA3 adapter"),
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_unsupported_adapter_types_are_refused(config, what):
    lora = edited_copy(peft_lora("qwen3", seed=1), f"lora-unsupported-{next(iter(config))}", config)
    with pytest.raises(AdapterError, match=rf"{what}.*merge_and_unload"):
        engine("qwen3", adapters=[lora])


def test_embedding_lora_tensors_are_refused():
    def with_embedding(tensors):
        return {**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 4)}

    lora = edited_copy(peft_lora("qwen3", seed=1), "lora-embedding", edit_tensors=with_embedding)
    with pytest.raises(AdapterError, match="lora_embedding_A.*embeddings"):
        engine("qwen3", adapters=[lora])


def test_missing_adapter_files_are_named():
    with pytest.raises(ModelLoadError, match="does not exist"):
        engine("qwen3", adapters=["/nonexistent/adapter"])
    no_weights = edited_copy(peft_lora("qwen3", seed=1), "lora-no-weights")
    (Path(no_weights) / "adapter_model.safetensors").rename(Path(no_weights) / "adapter_model.bin")
    with pytest.raises(ModelLoadError, match="adapter_model.safetensors' is missing.*safe_serialization"):
        engine("qwen3", adapters=[no_weights])
    (Path(no_weights) / "adapter_config.json").unlink()
    with pytest.raises(ModelLoadError, match="adapter_config.json' is missing"):
        engine("qwen3", adapters=[no_weights])


# -------------------------------------------------------------------------------------- CLI
def test_cli_generate_merges_each_lora_flag_in_order(capsys):
    from nanoplug.cli import main

    first, second = peft_lora("qwen3", seed=1), peft_lora("qwen3", seed=6, r=4, alpha=8)
    prompt = PROMPTS[0]
    argv = ["generate", "--model", base("qwen3"), "--device", "cpu", "--max-model-len", "256", "-n", str(STEPS)]
    assert main(argv + ["--lora", first, "--lora", second, prompt]) == 0
    printed = capsys.readouterr().out
    llm = engine("qwen3", adapters=[first, second])
    want = "".join(d.text for d in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=STEPS)))
    assert printed == want + "\n"
    assert want != "".join(d.text for d in engine("qwen3").stream(prompt, SamplingParams(temperature=0, max_tokens=STEPS)))
    assert main(argv + ["--lora", "/nonexistent/adapter", prompt]) == 2
    assert "does not exist" in capsys.readouterr().err
