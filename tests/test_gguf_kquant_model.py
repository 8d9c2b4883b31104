"""The engine on a GGUF whose weights are every type kept in the file's blocks (Q6_K, Q5_K, IQ4_NL in one fused
qkv; Q3_K, Q2_K, IQ4_XS, Q5_0; a Q5_1 tied embedding), through the C++ kernels (`gguf`) and the Triton ones
(`gguf_triton`, under TRITON_INTERPRET=1), against the same file dequantized by gguf-py (`quantization=None`):
the same greedy tokens and log-probabilities within float32 rounding with float activations, close ones
with the CPU's int8 activations and far closer ones with its int8x2. The blocks are random bytes (any quantizer's output is such bytes); the
kernels on blocks llama.cpp's quantizer wrote are in test_kquant_kernels.py."""
from __future__ import annotations

import pytest
import torch

from _checkpoints import prompt_logprobs
from _gguf_files import with_random_blocks
from _triton_interpreter import interpreted
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import write_gguf, write_random_checkpoint
from nanoplug.kernels.cpu.quant_ops import SIMD_Q5_0, quant_kernels
from nanoplug.kernels.gguf.cpu_linear import WIDENED, Activations

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
             tie_word_embeddings=True)
TYPES = {"attn_q": "Q6_K", "attn_k": "Q5_K", "attn_v": "IQ4_NL", "attn_output": "Q3_K", "ffn_gate": "Q2_K",
         "ffn_up": "IQ4_XS", "ffn_down": "Q5_0", "token_embd": "Q5_1"}
OPTIONS = dict(device="cpu", dtype="float32", kv_block_size=16, max_model_len=256, cpu={"kv_cache_gb": 0.05},
               enable_prefix_caching=False)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-kquants")
    checkpoint = write_random_checkpoint(folder / "q3", **SHAPE)
    base = write_gguf(checkpoint, folder / "base.gguf", formats={"token_embd": "F16"})
    return with_random_blocks(base, folder / "kquants.gguf", TYPES)


@pytest.fixture(scope="module")
def dense(kquant_gguf):
    llm = LLM(str(kquant_gguf), quantization=None, **OPTIONS)
    yield llm
    llm.close()


def check_engine(quant: LLM, dense: LLM, fmt_name: str, segments, widened=None) -> None:
    """`widened`: the formats the path keeps in another (the C++ path's Q5_0 as Q8_0 where it has no SIMD Q5_0)."""
    assert quant.choices["weight_format"].name == fmt_name and dense.choices["weight_format"].name == "dense"
    model = quant.engine.worker.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied head shares the blocks
    assert segments(model.model.layers[0].self_attn.qkv_proj) == ["Q6_K", "Q5_K", "IQ4_NL"]
    assert segments(model.model.layers[0].mlp.gate_up_proj) == ["Q2_K", "IQ4_XS"]
    kept = {(widened or {}).get(t, t) for t in TYPES.values()}
    for layer in (model.model.layers[0].self_attn.o_proj, model.model.layers[0].mlp.down_proj, model.lm_head):
        assert len(segments(layer)) == 1 and segments(layer)[0] in kept
    assert segments(model.model.layers[0].mlp.down_proj) == [(widened or {}).get("Q5_0", "Q5_0")]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt in PROMPTS:
        got = quant.generate([prompt], params, use_tqdm=False)[0].token_ids
        assert got == dense.generate([prompt], params, use_tqdm=False)[0].token_ids, prompt
    ids = dense.tokenizer.encode("Once upon a time, in a small village, there lived")
    diff = (prompt_logprobs(quant, ids) - prompt_logprobs(dense, ids)).abs().max().item()
    assert diff < 1e-3, diff


@pytest.mark.slow
def test_cpu_kernels_match_the_dequantized_engine(kquant_gguf, dense):
    quant = LLM(str(kquant_gguf), quantization="gguf", **OPTIONS)
    try:
        method = quant.engine.worker.model.lm_head.linear_method
        worker = quant.engine.worker
        graphs, worker.graphs = worker.graphs, None  # recorded decode steps keep the path they recorded
        method.set_activations(Activations("float", 0, "float"))
        widened = {} if quant_kernels().best in SIMD_Q5_0 else WIDENED  # a Q5_0 layer alone: its own panels
        check_engine(quant, dense, "gguf", lambda layer: [s.fmt for s in layer.weight.gguf.segments], widened)
        ids = dense.tokenizer.encode("Once upon a time, in a small village, there lived")
        ref, kl = prompt_logprobs(dense, ids), {}
        for act in ("int8", "int8x2"):  # llama.cpp's int8 activations: close, not equal; int8x2: float32's quality
            method.set_activations(Activations(act, 0, act))
            got = prompt_logprobs(quant, ids)
            kl[act] = (ref.exp() * (ref - got)).sum(-1).mean().item()
        assert kl["int8"] < 0.01 and kl["int8x2"] < kl["int8"] / 20, kl
        worker.graphs = graphs
    finally:
        quant.close()


@pytest.mark.slow
def test_triton_kernels_match_the_dequantized_engine(kquant_gguf, dense):
    import nanoplug.kernels.gguf.triton_kquants as kquants

    with interpreted(kquants):
        quant = LLM(str(kquant_gguf), quantization="gguf_triton", kv_cache="torch", attention="sdpa", **OPTIONS)
        try:
            check_engine(quant, dense, "gguf_triton", lambda layer: [s.weight.fmt for s in layer.weight.gguf.segments])
        finally:
            quant.close()
