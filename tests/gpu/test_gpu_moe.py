"""The fused MoE kernel on CUDA against the plain path (bf16 and float32, the H200 table's block sizes and the
defaults), captured in a CUDA graph, the one-launch router against `route` (in a graph too), and a Qwen3-MoE engine
under CUDA graphs against transformers.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_moe.py`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared helpers in tests/

from _checkpoints import checkpoint, hf_greedy, prompt_ids  # noqa: E402
from nanoplug import LLM, SamplingParams  # noqa: E402
from nanoplug.api.layers import FusedMoE, experts_plain, route  # noqa: E402
from nanoplug.kernels.moe import fused_moe, routing  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(m, e, k, h, i, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, h, generator=g, device="cuda").to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device="cuda") * 0.05).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device="cuda") * 0.05).to(dtype)
    weights, ids = route(torch.randn(m, e, generator=g, device="cuda"), k, True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("m", [1, 3, 64, 257])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_plain(m, dtype):
    x, w13, w2, weights, ids = _inputs(m, 128, 8, 2048, 768, dtype)
    want = experts_plain(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_moe.fused_experts(x, w13, w2, weights, ids).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert float((got - want).abs().max() / want.abs().max()) < tol


@pytest.mark.parametrize("m", [1, 3, 8, 64, 257])  # the GEMVs up to 8 tokens (fp8), the grouped GEMM
def test_fp8_experts_equal_plain_over_their_dequantization(m):
    """bf16 activations, e4m3 experts with per-row scales (the fp8 format's experts): the GEMV path and the
    grouped GEMM against the reference over the dequantized weights."""
    from nanoplug.plugins.weight_formats.fp8 import quantize_rows

    x, w13, w2, weights, ids = _inputs(m, 128, 8, 2048, 768, torch.bfloat16)
    (q13, s13), (q2, s2) = quantize_rows(w13), quantize_rows(w2)
    want = experts_plain(x.float(), q13, q2, weights, ids, scales=(s13, s2))
    got = fused_moe.fused_experts(x, q13, q2, weights, ids, scales=(s13, s2)).float()
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2


@pytest.mark.parametrize("m", [1, 8])  # the GEMV path, the grouped GEMM
def test_kernel_in_a_cuda_graph(m):
    x, w13, w2, weights, ids = _inputs(m, 128, 8, 2048, 768, torch.bfloat16)
    out = fused_moe.fused_experts(x, w13, w2, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe.fused_experts(x, w13, w2, weights, ids)
    new_ids = torch.roll(ids, 1, dims=1)  # each expert now with another slot's weight
    ids.copy_(new_ids)
    graph.replay()
    assert torch.allclose(captured.float(), fused_moe.fused_experts(x, w13, w2, weights, ids).float(), atol=1e-3)
    assert not torch.equal(captured, out)


def _same_experts(logits, got, want):
    """The same weights, and experts of the same probabilities in the same order: experts whose probabilities
    tie (frequent in bfloat16 scores) may come in either order, which torch.topk leaves open."""
    (weights, ids), (want_w, want_ids) = got, want
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.allclose(weights, want_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, want_ids))
    assert (ids.sort(1).values.diff(dim=1) > 0).all()  # each expert once


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_kernel_equals_route_in_a_cuda_graph(renormalize):
    g = torch.Generator(device="cuda").manual_seed(1)
    for t, e, k in ((1, 128, 8), (64, 128, 8), (257, 60, 4), (5, 8, 2)):
        logits = torch.randn(t, e, generator=g, device="cuda").to(torch.bfloat16)
        _same_experts(logits, routing.route(logits, k, renormalize), route(logits, k, renormalize))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = routing.route(logits, k, renormalize)
        logits.copy_(torch.randn(t, e, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        _same_experts(logits, captured, route(logits, k, renormalize))


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_engine_under_graphs_equals_transformers(name):
    # float32 to compare with transformers token for token; triton decodes float32 under graphs (sdpa's
    # varlen path, the graphs-capable one, takes only fp16/bf16: float32 sdpa decodes eager by design)
    llm = LLM(checkpoint(name), dtype="float32", attention="triton", kv_block_size=16, num_kv_blocks=64,
              max_model_len=256)
    moes = [m for m in llm.engine.worker.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.fused is not None for m in moes)  # the platform installed the kernel
    prompts = prompt_ids(name)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    assert got == [hf_greedy(name, ids, 8) for ids in prompts]
    assert llm.engine.worker.report().stats.graph_replays > 0
