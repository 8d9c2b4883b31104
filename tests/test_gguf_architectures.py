"""GGUF files of every architecture with a model plugin, written as llama.cpp's converter writes them
(tests/_gguf_arches.py), load and give transformers' greedy tokens on the same weights, float32, batched prompts of
mixed lengths (longer than the tiny sliding windows). Where the converter drops something, the reference is what
the file says, as llama.cpp runs it: Mistral's window and Qwen2's use_sliding_window are not written, so those
files attend fully. Also: quantized experts (Q8_0) against nanoplug's dequantized path on the same file, and what
is refused."""
from __future__ import annotations

import contextlib
from functools import lru_cache

import gguf
import numpy as np
import pytest
import torch

from _checkpoints import scratch_dir
from _gguf_arches import tokenizer_fields, write_gguf
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.checkpoint.gguf_file import GGUFFile
from nanoplug.errors import ModelLoadError

VOCAB = 49152  # the default model's tokenizer, whose metadata the files carry
IDS = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False)
# name -> (architecture, config overrides, the reference's overrides: what the GGUF says where it differs). The MoE
# layers are all sparse: gguf-py names no dense MLP for qwen2moe/qwen3moe, so the converter writes none
MODELS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True,
                                              seed=4), {}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, norm_topk_prob=False,
                                              seed=5), {}),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, seed=6),
                {}),
    "mistral": ("MistralForCausalLM", dict(sliding_window=8, seed=20), dict(sliding_window=None)),
    "qwen2_swa": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, seed=21),
                  dict(use_sliding_window=False, layer_types=["full_attention"] * 2)),
    "phi3": ("Phi3ForCausalLM", dict(sliding_window=12, seed=22), {}),
    # llama.cpp scales q by head_dim ** -0.5 (the file has no query_pre_attn_scalar): the checkpoints say the same
    "gemma2": ("Gemma2ForCausalLM", dict(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=0.5, final_logit_softcapping=30.0,
                                         tie_word_embeddings=True, seed=25), {}),
    # six layers: llama.cpp's pattern (five local, one global), global rope 1e6 scaled linearly by 2
    "gemma3": ("Gemma3ForCausalLM", dict(num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16,
                                         final_logit_softcapping=30.0, tie_word_embeddings=True,
                                         rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 10000.0},
                                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 1000000.0}},
                                         seed=23), {}),
}
PROMPT_LENGTHS = [30, 5, 17]
NEW_TOKENS = 8
OPTIONS = dict(device="cpu", dtype="float32", kv_block_size=16, max_model_len=128, cpu={"kv_cache_gb": 0.05},
               enable_prefix_caching=False)


@lru_cache(maxsize=None)
def _tokenizer():
    from nanoplug.checkpoint.default_model import GGUF_NAME, default_model_path

    return tokenizer_fields(default_model_path(progress=True) / GGUF_NAME)


@lru_cache(maxsize=None)
def checkpoint(name: str) -> str:
    arch, shape, _ = MODELS[name]
    shape = {**IDS, **shape}
    seed = shape.pop("seed")
    return str(write_random_checkpoint(scratch_dir(f"gguf_{name}"), arch, seed=seed, tokenizer=False, **shape))


@lru_cache(maxsize=None)
def gguf_file(name: str, types: tuple = ()) -> str:
    folder = scratch_dir(f"gguf_{name}_file{len(types)}")
    return str(write_gguf(checkpoint(name), folder / f"{name}.gguf", _tokenizer(), dict(types)))


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def hf_greedy(name: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32, **MODELS[name][2]).eval()
    out = []
    for ids in prompts():
        got = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        out.append(got[0, len(ids):].tolist())
    return out


def greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_converted_gguf_gives_transformers_greedy_tokens(name):
    llm = LLM(gguf_file(name), **OPTIONS)
    try:
        want = MODELS[name][0] if name != "mistral" else "LlamaForCausalLM"  # written as llama, run as llama
        assert llm.choices["model"].name == want
        assert greedy(llm) == hf_greedy(name)
    finally:
        llm.close()


def test_the_config_says_what_llama_cpp_reads():
    def config(name):
        f = GGUFFile(gguf_file(name))
        return f.kind, f._config(None)

    kind, cfg = config("mixtral")
    assert kind == "mixtral" and (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.sliding_window) == (8, 2, None)
    _, cfg = config("qwen3_moe")
    assert (cfg.mlp_only_layers, cfg.norm_topk_prob, cfg.moe_intermediate_size) == ([], True, 32)
    _, cfg = config("qwen2_moe")
    assert (cfg.mlp_only_layers, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size) == ([], False, 48)
    _, cfg = config("gemma3")
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and cfg.sliding_window == 8
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
    _, cfg = config("gemma2")
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.attn_logit_softcapping == 0.5
    _, cfg = config("phi3")
    assert cfg.sliding_window == 12


QUANTIZED = (("ffn_gate_exps", "Q8_0"), ("ffn_up_exps", "Q8_0"), ("ffn_down_exps", "Q8_0"), ("attn_q", "Q8_0"),
             ("attn_output", "Q8_0"), ("token_embd", "F16"))


@pytest.mark.parametrize("fmt", ["gguf", "gguf_triton"])
def test_experts_load_quantized_and_dense_alike(fmt, caplog):
    """Q8_0 experts and attention (F16 embedding): both GGUF formats keep the attention's and the experts' blocks (the
    CPU's a 2-D layer of its kernels per expert and projection; gguf_triton every expert of a projection stacked,
    one GEMV launch for a few pairs and one dequantize for more), each path equal to the plain loop over the
    dense engine's weights. The same file loaded dense gives the same tokens. gguf_triton through the Triton
    interpreter."""
    import nanoplug.kernels.gguf.triton_kernels as triton_kernels
    from _triton_interpreter import interpreted
    from nanoplug.api.layers.moe import StackedExperts, experts_plain
    from nanoplug.kernels.gguf.cpu_linear import Activations
    from nanoplug.plugins.platforms.cpu.graphs import CaptureError, record

    path = gguf_file("qwen2_moe", QUANTIZED)
    types = {t.gguf_name.split(".")[-2]: t.type_name for t in GGUFFile(path).tensors()}
    assert types["ffn_up_exps"] == "Q8_0" and types["token_embd"] == "F16"
    with interpreted(triton_kernels) if fmt == "gguf_triton" else contextlib.nullcontext():
        # the torch KV cache: under the interpreter "auto" would take triton's, whose kernels were defined without it
        with caplog.at_level("INFO", logger="nanoplug"):
            quant = LLM(path, quantization=fmt, kv_cache="torch", **OPTIONS)
        kept = fmt == "gguf"
        assert "dequantized at load" not in caplog.text
        dense = LLM(path, quantization=None, kv_cache="torch", **OPTIONS)
        try:
            assert quant.choices["weight_format"].name == fmt and dense.choices["weight_format"].name == "dense"
            model = quant.engine.worker.model
            segments = model.model.layers[1].self_attn.qkv_proj.weight.gguf.segments
            formats = [s[2] for s in segments] if fmt == "gguf" else [getattr(s.weight, "fmt", None) for s in segments]
            assert formats[0] == "Q8_0" and len(formats) == 2  # q in its blocks, k and v one float part
            experts = model.model.layers[1].mlp.experts
            if kept:
                layers = [*experts.gate_up_proj.layers, *experts.down_proj.layers]
                assert len(layers) == 16 and all([s.fmt for s in m.weight.gguf.segments] == ["Q8_0"] for m in layers)
                quant_method = layers[0].linear_method
                quant_method.set_activations(Activations("float", 0, "float"))  # the kept experts against the plain
                dense_experts = dense.engine.worker.model.model.layers[1].mlp.experts  # loop over the same weights
                gen = torch.Generator().manual_seed(0)
                x, weights = torch.randn(5, layers[0].input_size, generator=gen), torch.rand(5, 2, generator=gen)
                ids = torch.tensor([[0, 3], [3, 7], [1, 0], [7, 6], [5, 2]])
                torch.testing.assert_close(experts(x, weights, ids), experts_plain(
                    x, dense_experts.gate_up_proj.weight, dense_experts.down_proj.weight, weights, ids), rtol=1e-5, atol=1e-5)
                with pytest.raises(CaptureError, match="nonzero"):  # a decode step through them is never replayed
                    record(lambda i, p: experts(x, weights, ids), x, x)  # with the recording's choice of experts
                quant_method.set_activations(Activations())  # greedy below in the default mode (int8x2)
            else:
                up, down = experts.gate_up_proj, experts.down_proj
                assert isinstance(up, StackedExperts) and up.quantized and down.quantized
                assert (up.stacked.fmt, up.stacked.rows, down.stacked.fmt) == ("Q8_0", 8 * 64, "Q8_0")
                dense_experts = dense.engine.worker.model.model.layers[1].mlp.experts
                gen = torch.Generator().manual_seed(0)
                assert up.pair_limit == down.pair_limit == 68  # 8 * (1 + 8 / (34 / 32)): Q8_0 under float32
                x, weights = torch.randn(35, up.cols, generator=gen), torch.rand(35, 2, generator=gen)
                ids = torch.randint(0, 8, (35, 2), generator=gen)
                for tokens in (3, 35):  # 6 pairs: each reads its expert's blocks; 70: every expert dequantized
                    torch.testing.assert_close(experts(x[:tokens], weights[:tokens], ids[:tokens]), experts_plain(
                        x[:tokens], dense_experts.gate_up_proj.weight, dense_experts.down_proj.weight,
                        weights[:tokens], ids[:tokens]), rtol=1e-5, atol=1e-5)
            if fmt == "gguf":
                model.lm_head.linear_method.set_activations(Activations("float", 0, "float"))
            assert greedy(quant) == greedy(dense)
        finally:
            quant.close()
            dense.close()


def _copy(source: str, out, **fields) -> str:
    """`source` with some general.* / llama.* metadata set (e.g. name="mistral", sliding_window=8)."""
    src = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), arch="llama")
    for field in src.fields.values():
        if field.name in ("general.architecture", "general.name") or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_name(fields.get("name", "tiny"))
    if "sliding_window" in fields:
        writer.add_sliding_window(fields["sliding_window"])
    for t in src.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)


def test_experts_one_tensor_each_as_older_converters_wrote_mixtral(tmp_path):
    """blk.L.ffn_gate.E.weight (llama.cpp still reads them): the same model as the merged file's."""
    src = gguf.GGUFReader(gguf_file("mixtral"))
    out = tmp_path / "legacy.gguf"
    writer = gguf.GGUFWriter(str(out), arch="llama")
    for field in src.fields.values():
        if field.name != "general.architecture" and not field.name.startswith("GGUF."):
            vtype = field.types[0]
            writer.add_key_value(field.name, field.contents(), vtype,
                                 sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        data = np.asarray(t.data)
        if "_exps." not in t.name:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
            continue
        for e in range(data.shape[0]):
            writer.add_tensor(t.name.replace("_exps.", f".{e}."), np.ascontiguousarray(data[e]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    llm = LLM(str(out), **OPTIONS)
    try:
        assert greedy(llm) == hf_greedy("mixtral")
    finally:
        llm.close()


def test_a_llama_file_named_mistral_stays_llama(tmp_path):
    """transformers reads a llama GGUF whose general.name is "mistral" as a MistralConfig with its default
    4096-token window; the file (and llama.cpp) say llama, full attention."""
    config, _ = GGUFFile(_copy(gguf_file("mistral"), tmp_path / "m.gguf", name="mistral")).hf_config_and_tokenizer()
    assert (config.model_type, getattr(config, "sliding_window", None)) == ("llama", None)


def test_what_the_file_cannot_say_is_refused(tmp_path):
    """A llama GGUF naming a sliding window (llama.cpp ignores it; which layers slide is not said) is refused."""
    out = _copy(gguf_file("mistral"), tmp_path / "windowed.gguf", sliding_window=8)
    with pytest.raises(ModelLoadError, match="sliding window of 8 tokens"):
        LLM(out, **OPTIONS)
