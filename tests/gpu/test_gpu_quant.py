"""Quantized weights on CUDA: the Triton GGUF kernels and the fp8 `_scaled_mm` path against plain
references, and engines on a GGUF model under CUDA graphs against eager.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_quant.py` (needs gguf-py importable)."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared helpers in tests/

from _checkpoints import prompt_logprobs  # noqa: E402
from nanoplug import LLM, SamplingParams  # noqa: E402
from nanoplug.bench.checkpoints import quantize_q4_k, write_gguf, write_random_checkpoint  # noqa: E402
from nanoplug.kernels.gguf import triton_kernels as kernels  # noqa: E402
from nanoplug.kernels.gguf.blocks import FORMATS, repack  # noqa: E402

pytestmark = pytest.mark.gpu
ROWS, COLS = 1000, 4096  # rows not a multiple of any block
MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q4_1",
         "ffn_up": "Q8_0", "ffn_down": "Q4_K", "token_embd": "Q8_0"}
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=128, tie_word_embeddings=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def quantized(fmt: str, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    blocks = quantize_q4_k(w) if fmt == "Q4_K" else gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[fmt]).reshape(ROWS, COLS)
    packed = repack(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), ROWS, COLS).to(torch.device("cuda"))
    return packed, torch.from_numpy(ref).cuda()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_on_cuda(fmt):
    packed, ref = quantized(fmt)
    got = kernels.dequantize(packed, torch.empty(ROWS, COLS, device="cuda"))
    # one multiply (Q8_0, Q4_0) is exact; a multiply-add may be fused into one FMA on the GPU: 1 ulp
    torch.testing.assert_close(got, ref, rtol=2.4e-7, atol=1e-9)
    ids = torch.tensor([5, 0, 999, 5], device="cuda")
    bf = kernels.dequantize(packed, torch.empty(4, COLS, dtype=torch.bfloat16, device="cuda"), ids)
    assert torch.equal(bf, got[ids].to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 7, 16, 300])  # decode: the GEMV, the fused kernel; prefill: dequantize + mm
def test_matmul_bf16_on_cuda(fmt, m):
    packed, ref = quantized(fmt, seed=1)
    x = torch.randn(m, COLS, device="cuda").to(torch.bfloat16)
    got = kernels.linear(x, packed, torch.empty(m, ROWS, dtype=torch.bfloat16, device="cuda")).float()
    want = x.float() @ ref.T
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel  # bfloat16 output (and, past the GEMV, bfloat16 weights): 2^-9 relative each


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [kernels.GemvConfig(2, 32, 1), kernels.GemvConfig(4, 16, 2),
                                    kernels.GemvConfig(4, 32, 2, unroll=True)])  # float activations
def test_ptx_conversions_equal_the_conversion_instruction(fmt, config, monkeypatch):
    """The GEMV and dequantization with quants turned into floats by PRMT (the fast path) give the same
    bits as with the conversion instruction (the plain path, the interpreter's), and the GEMV stays within
    float32 rounding of float64 dequantize-then-matmul."""
    packed, ref = quantized(fmt, seed=3)
    x = torch.randn(2, COLS, device="cuda").to(torch.bfloat16)
    runs = {}
    for ptx in (True, False):
        monkeypatch.setattr(kernels, "_ptx", lambda ptx=ptx: ptx)
        runs[ptx] = (kernels.gemv(x, packed, torch.empty(2, ROWS, device="cuda"), config),
                     kernels.dequantize(packed, torch.empty(ROWS, COLS, device="cuda")))
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])
    exact = x.double() @ ref.double().T
    bound = 1e-5 * (x.double().abs() @ ref.double().abs().T)
    assert ((runs[True][0].double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [kernels.GemvConfig(8, 32, 2, int8=True), kernels.GemvConfig(16, 64, 4, True, True)])
def test_int8_gemv_dp4a_equals_its_emulation_and_keeps_its_bound(fmt, config, monkeypatch):
    """The GEMV on int8 activations: dp4a (PTX) gives the bits of its plain emulation, and the result is the
    dequantized weights times activations rounded to int8 a group of 32: within sum |w| d_x / 2 (d_x: the
    group's largest |x| / 127) plus float32 rounding of the exact product."""
    packed, ref = quantized(fmt, seed=4)
    x = torch.randn(2, COLS, device="cuda").to(torch.bfloat16)
    runs = {}
    for ptx in (True, False):
        monkeypatch.setattr(kernels, "_ptx", lambda ptx=ptx: ptx)
        runs[ptx] = kernels.gemv(x, packed, torch.empty(2, ROWS, device="cuda"), config)
    assert torch.equal(runs[True], runs[False])
    if config.unroll:
        plain = kernels.gemv(x, packed, torch.empty(2, ROWS, device="cuda"), config._replace(unroll=False))
        assert torch.equal(runs[True], plain)
    dx = x.double().view(2, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(2, COLS) / 127
    exact = x.double() @ ref.double().T
    bound = (dx / 2) @ ref.double().abs().T + 1e-5 * (x.double().abs() @ ref.double().abs().T)
    err = (runs[True].double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # activations were quantized (the float GEMV's error is orders smaller)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("m", [1, 7])
def test_kernels_replay_in_a_cuda_graph(fmt, m):
    packed, _ = quantized(fmt, seed=2)
    x = torch.randn(m, COLS, device="cuda").to(torch.bfloat16)
    out = torch.empty(m, ROWS, dtype=torch.bfloat16, device="cuda")
    eager = kernels.linear(x, packed, out.clone())  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.linear(x, packed, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_fp8_scaled_mm_matches_the_reference():
    from nanoplug.api import Layers
    from nanoplug.plugins.weight_formats.fp8 import FP8, FP8_MAX, FP8LinearMethod, dequantize_rows

    class Group:
        rank, world_size = 0, 1

    torch.manual_seed(0)
    method = FP8LinearMethod()
    with torch.device("cuda"):
        layer = Layers(Group(), method).column(4096, 1024, bias=False)
    w = (torch.randn(1024, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    layer.weight_loader(layer.weight, w)
    wd = dequantize_rows(layer.weight, layer.weight_scale, torch.float32)
    for m in (1, 7, 16, 300):
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        got = layer(x).float()
        assert method.rowwise, "torch._scaled_mm with row-wise scales should run on this GPU"
        xs = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        xq = (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * xs
        emulated = xq @ wd.T  # the same quantized operands in float32
        rel = ((got - emulated).norm() / emulated.norm()).item()
        assert rel < 1e-2, (m, rel)
        plain = F.linear(x.float(), wd)  # activations unquantized (the reference path)
        rel = ((got - plain).norm() / plain.norm()).item()
        assert rel < 0.06, (m, rel)  # e4m3 activations: 2^-4 relative at most per entry


# ------------------------------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-gpu")
    return write_gguf(write_random_checkpoint(folder / "q3", **SHAPE), folder / "mixed.gguf", formats=MIXED)


def greedy(llm, prompts=PROMPTS, n=16):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_gguf_engine_graphs_match_eager_and_the_dequantized_engine(mixed_gguf):
    options = dict(device="cuda", dtype="bfloat16", max_model_len=512, cuda={"memory_utilization": 0.3})
    results = {}
    # graphs without the fused small-op kernels, so that only the capture differs from eager
    for name, extra in (("eager", dict(cuda={"enforce_eager": True, "memory_utilization": 0.3})),
                        ("graphs", dict(cuda={"compile_fused_ops": False, "memory_utilization": 0.3})),
                        ("dense", dict(quantization=None))):
        llm = LLM(str(mixed_gguf), **{**options, **extra})
        try:
            if name != "dense":
                assert llm.choices["weight_format"].name == "gguf_triton"  # "auto" on CUDA
                assert type(llm.engine.worker.model.lm_head.linear_method).__name__ == "TritonGGUFLinearMethod"
                assert (llm.engine.worker.graphs is None) == (name == "eager"), "decode graphs were not captured"
            ids = llm.tokenizer.encode(PROMPTS[2] + " there lived an old clockmaker who")
            results[name] = greedy(llm), prompt_logprobs(llm, ids)
        finally:
            llm.close()
    assert results["graphs"][0] == results["eager"][0]
    diff = (results["graphs"][1] - results["dense"][1]).abs().mean().item()
    assert diff < 0.05, diff  # the same dequantized values; bfloat16 rounding of activations and weights


def test_fp8_engine_graphs_match_eager(tmp_path):
    folder = write_random_checkpoint(tmp_path / "q3", **{**SHAPE, "tie_word_embeddings": False})
    tokens = {}
    for eager in (True, False):
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=512,
                  cuda={"enforce_eager": eager, "compile_fused_ops": False, "memory_utilization": 0.3})
        try:
            assert llm.engine.worker.model.lm_head.linear_method.rowwise is True
            assert (llm.engine.worker.graphs is None) == eager
            tokens[eager] = greedy(llm, PROMPTS[:1])  # batch 1 both ways: the same GEMM shapes
        finally:
            llm.close()
    assert tokens[True] == tokens[False]
