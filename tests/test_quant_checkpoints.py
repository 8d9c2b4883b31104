"""Pre-quantized checkpoints written by the libraries that define them (nanoplug/bench/quantize.py: compressed-
tensors' compressors as llmcompressor saves, transformers' Fp8Quantize, AutoAWQ's packer and its GPTQ
conversion), served by their weight formats on the CPU, against those libraries:

- each layer's dequantized weight equals the library's own dequantization exactly (compressed-tensors'
  decompressors, transformers' fine-grained FP8 `Fp8Dequantize`, AutoAWQ's `dequantize_gemm`);
- greedy tokens equal transformers' on the same checkpoint where transformers loads it on the CPU
  (compressed-tensors schemes, including the W8A8 / fp8 dynamic activation quantization; fp8 blocks, which
  transformers dequantizes on a CPU), else transformers' model with the library's dequantized weights;
- what cannot be served is refused with the reason (another quant_method, an unserved scheme)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _checkpoints import scratch_dir
from _quant_checkpoints import plain, quantized
from nanoplug import LLM, SamplingParams

ct = pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors (the test extra)")
ENGINE = dict(device="cpu", dtype="float32", kv_block_size=16, max_model_len=256, cpu={"kv_cache_gb": 0.05})
PROMPT = "The capital of France is"
STEPS = 12


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def ct_reference(folder: Path, module: str) -> torch.Tensor:
    """compressed-tensors' own decompressor's weight for `module`."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = next(iter(q["config_groups"].values()))
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                input_activations=group.get("input_activations"))
    state = {k.removeprefix(module + "."): v for k, v in tensors(folder).items() if k.startswith(module + ".")}
    return BaseCompressor.load_from_registry(group["format"]).decompress(state, scheme)["weight"]


def fp8_reference(folder: Path, module: str) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    t = tensors(folder)
    return Fp8Dequantize(None)._dequantize_one(t[f"{module}.weight"], t[f"{module}.weight_scale_inv"],
                                               output_dtype=torch.float32)


def awq_reference(folder: Path, module: str) -> torch.Tensor:
    pytest.importorskip("awq", reason="pip install --no-deps autoawq==0.2.9 (.ci/run does; its dependencies would "
                                      "replace torch)")
    from awq.utils.packing_utils import dequantize_gemm

    t = tensors(quantized("awq", 64))  # the gptq checkpoint holds the same weights in GPTQ's layout
    return dequantize_gemm(t[f"{module}.qweight"], t[f"{module}.qzeros"], t[f"{module}.scales"], 4, 64).t()


def engine_weight(llm, layer_name: str, rows: slice | None, dtype: torch.dtype) -> torch.Tensor:
    """The engine layer's weight dequantized in `dtype` (the reference's: AutoAWQ rounds to float16)."""
    layer = llm.engine.worker.model.get_submodule(layer_name)
    w = layer.linear_method.dequantized(layer, dtype)
    return w if rows is None else w[rows]


def greedy(llm) -> list[int]:
    ids = llm.tokenizer.encode(PROMPT)
    return list(llm.generate([ids], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
                             use_tqdm=False)[0].token_ids)


@torch.no_grad()
def hf_greedy(model, tok_folder: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tok_folder)).encode(PROMPT)
    out = model.eval().generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_with_weights(weights: dict[str, torch.Tensor]):
    """transformers' model of the plain checkpoint with these weights (a library's dequantization)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(plain()), dtype=torch.float32)
    with torch.no_grad():
        for name, w in weights.items():
            model.get_parameter(name).copy_(w.float())
    return model


# scheme, group size, format plugin, reference dequantization, whether transformers loads it on CPU
SLOW = pytest.mark.slow  # ~30 s each on two shared cores: the two headline formats run by default
CASES = [
    ("w4a16", 128, "compressed_tensors", ct_reference, True),
    pytest.param("w4a16_asym", 64, "compressed_tensors", ct_reference, False, marks=SLOW),  # transformers 5.24
    pytest.param("w8a8", 128, "compressed_tensors", ct_reference, True, marks=SLOW),  # refuses its packed zeros
    pytest.param("fp8_channel", 128, "compressed_tensors", ct_reference, True, marks=SLOW),
    pytest.param("fp8_block_ct", 128, "compressed_tensors", ct_reference, True, marks=SLOW),
    ("fp8_block", 128, "fp8_checkpoint", fp8_reference, True),
    pytest.param("awq", 64, "awq", awq_reference, False, marks=SLOW),
    pytest.param("gptq", 64, "gptq", awq_reference, False, marks=SLOW),
]
LAYERS = [  # (checkpoint module, engine layer, rows of the engine layer)
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.qkv_proj", slice(0, 256)),
    ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.qkv_proj", slice(384, 512)),
    ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.gate_up_proj", slice(256, 512)),
    ("model.layers.1.mlp.down_proj", "model.layers.1.mlp.down_proj", None),
]


@pytest.mark.parametrize("scheme,group,fmt,reference,hf_loads", CASES)
def test_checkpoint_served_as_the_library_defines_it(scheme, group, fmt, reference, hf_loads):
    folder = quantized(scheme, group)
    llm = LLM(str(folder), **ENGINE)
    try:
        assert llm.choices["weight_format"].name == fmt
        layer = llm.engine.worker.model.model.layers[0].mlp.down_proj
        assert layer.kind != "dense" and layer.weight.numel() == 0  # kept quantized, no dense copy
        # the C++ kernels multiply int4 and int8 on a CPU; fp8 (no fp8 GEMM here) is dequantized per call
        assert (layer.kernel is not None) == (layer.kind in ("int4", "int8")), layer.kind
        refs = {}
        for module, engine_layer, rows in LAYERS:
            ref = reference(folder, module)
            refs[module + ".weight"] = ref
            assert torch.equal(engine_weight(llm, engine_layer, rows, ref.dtype), ref), module
        tokens = greedy(llm)
    finally:
        llm.close()
    if hf_loads:
        from transformers import AutoModelForCausalLM

        want = hf_greedy(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32), folder)
    else:
        weights = {f"{m}.weight": reference(folder, m) for m in _linear_modules()}
        want = hf_greedy(hf_with_weights({**weights, **_dense_tensors(folder)}), folder)
    assert tokens == want


def _linear_modules() -> list[str]:
    return [f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _dense_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors(folder).items() if v.is_floating_point() and "proj" not in k}


def _edited(scheme: str, name: str, edit) -> Path:
    src = quantized(scheme, 128)
    dst = scratch_dir(name)
    shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_refusals_name_the_format_and_what_serves():
    from nanoplug.api.errors import NanoplugError

    def other_method(q):
        q["quant_method"] = "bitsandbytes"

    with pytest.raises(NanoplugError, match=r"'bitsandbytes'.*nanoplug keeps .*awq.*compressed-tensors.*fp8.*gptq"):
        LLM(str(_edited("w4a16", "quant-bnb", other_method)), **ENGINE)

    def static_acts(q):
        q["config_groups"]["group_0"]["input_activations"]["dynamic"] = False

    with pytest.raises(NanoplugError, match=r"compressed-tensors checkpoint cannot be served: its activations have "
                                            r"static scales.*nanoplug serves pack-quantized int4"):
        LLM(str(_edited("w8a8", "quant-static", static_acts)), **ENGINE)

    def three_bits(q):
        q["config_groups"]["group_0"]["weights"]["num_bits"] = 3

    with pytest.raises(NanoplugError, match=r"pack-quantized int3 group weights .* are not served"):
        LLM(str(_edited("w4a16", "quant-int3", three_bits)), **ENGINE)


@pytest.mark.parametrize("scheme,fmt,kind", [("fp8_block", "fp8_checkpoint", "fp8_block"), ("awq", "awq", "int4")])
def test_a_quantized_moe_checkpoint_keeps_its_experts_as_stored(scheme, fmt, kind, tmp_path):
    """The experts of a pre-quantized Qwen3-MoE checkpoint (block-scaled fp8; AWQ int4) stay as stored, a layer per
    expert and projection (such checkpoints were refused): each expert's weight is the library's own dequantization
    exactly (transformers' Fp8Dequantize, AutoAWQ's dequantize_gemm), and the greedy tokens are transformers' on
    those dequantized weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from nanoplug.bench.checkpoints import write_random_checkpoint
    from nanoplug.bench.quantize import write_quantized_checkpoint

    src = write_random_checkpoint(tmp_path / "moe", "Qwen3MoeForCausalLM", seed=3, hidden_size=128, intermediate_size=256,
                                  moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    group = 128 if scheme == "fp8_block" else 64
    folder = write_quantized_checkpoint(src, tmp_path / f"moe-{scheme}", scheme, group,
                                        torch.float32 if scheme == "fp8_block" else torch.float16)
    stored = tensors(folder)
    if scheme == "fp8_block":
        def reference(module: str) -> torch.Tensor:
            return fp8_reference(folder, module)
        modules = [k.removesuffix(".weight") for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    else:
        pytest.importorskip("awq", reason="pip install --no-deps autoawq==0.2.9 (.ci/run does)")
        from awq.utils.packing_utils import dequantize_gemm

        def reference(module: str) -> torch.Tensor:
            return dequantize_gemm(stored[f"{module}.qweight"], stored[f"{module}.qzeros"], stored[f"{module}.scales"],
                                   4, group).t()
        modules = [k.removesuffix(".qweight") for k in stored if k.endswith(".qweight")]
    expert = "model.layers.1.mlp.experts.2"
    assert f"{expert}.up_proj" in modules
    dense = tmp_path / "moe-dequantized"  # the reference: every quantized tensor through the library's dequantization
    shutil.copytree(src, dense)
    for f in dense.glob("*.safetensors"):
        f.unlink()
    plain_tensors = {k: v.float() for k, v in stored.items()
                     if v.is_floating_point() and not any(k.startswith(m + ".") for m in modules)}
    save_file({**plain_tensors, **{f"{m}.weight": reference(m).float().contiguous() for m in modules}},
              str(dense / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(folder), **ENGINE)
    try:
        assert llm.choices["weight_format"].name == fmt
        layers = llm.engine.worker.model.model.layers[1].mlp.experts.gate_up_proj.layers
        assert len(layers) == 4 and all(m.kind == kind and m.weight.numel() == 0 for m in layers)
        want = reference(f"{expert}.up_proj")
        assert torch.equal(layers[2].linear_method.dequantized(layers[2], want.dtype)[128:], want)
        tokens = greedy(llm)
    finally:
        llm.close()
    assert tokens == hf_greedy(AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32), folder)
