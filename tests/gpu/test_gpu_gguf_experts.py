"""An MoE's experts kept in their GGUF blocks on CUDA (kernels/gguf/triton_experts.py): Q4_K gate_up (the split
layout) and Q5_0 down (the file's blocks) at the 30B-A3B shape's per-expert sizes, against the plain loop over
gguf-py's dequantized weights, through both paths (a GEMV per (token, slot) pair; every expert dequantized for the
fused kernel), each captured in a CUDA graph and replayed on other experts. Prints the batch-1 time of one layer's
experts against bf16 experts through the fused kernel's GEMV.

Run on the GPU machine: `pytest -m gpu -s tests/gpu/test_gpu_gguf_experts.py` (needs gguf-py importable)."""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared helpers in tests/

from nanoplug.api.layers import experts_plain, experts_stacked, route  # noqa: E402
from nanoplug.bench.checkpoints import quantize_q4_k  # noqa: E402
from nanoplug.checkpoint.gguf_file import GGUFTensor  # noqa: E402
from nanoplug.kernels.gguf.triton_experts import StackedGGUFExperts  # noqa: E402
from nanoplug.kernels.moe import fused_moe  # noqa: E402

pytestmark = pytest.mark.gpu
E, K, HIDDEN, INTER = 16, 8, 2048, 768


def _tensor(fmt: str, rows: int, cols: int, seed: int) -> tuple[GGUFTensor, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    kind = gguf.GGMLQuantizationType[fmt]
    blocks = quantize_q4_k(w) if fmt == "Q4_K" else gguf.quants.quantize(w, kind)
    ref = gguf.quants.dequantize(blocks, kind).reshape(rows, cols)
    return GGUFTensor("w", "w", int(kind), fmt, (rows, cols), blocks), torch.from_numpy(ref)


@pytest.fixture(scope="module")
def experts():
    up = StackedGGUFExperts(E, 2 * INTER, HIDDEN, 2, torch.bfloat16, None).cuda()
    down = StackedGGUFExperts(E, HIDDEN, INTER, 1, torch.bfloat16, None).cuda()
    w13, w2 = [], []
    for e in range(E):
        for part in range(2):
            t, ref = _tensor("Q4_K", INTER, HIDDEN, 10 * e + part)
            up.weight_loader(up.weight, t, (e, part))
            w13.append(ref)
        t, ref = _tensor("Q5_0", HIDDEN, INTER, 10 * e + 5)
        down.weight_loader(down.weight, t, e)
        w2.append(ref)
    up.finish()
    down.finish()
    assert up.quantized and down.quantized and up.weight.is_cuda and down.weight.is_cuda
    assert (up.pair_limit, down.pair_limit) == (101, 109)  # 16 * (1 + 4 / bytes a weight): Q4_K 0.75 split, Q5_0 22/32
    dense = (torch.cat(w13).view(E, 2 * INTER, HIDDEN).cuda(), torch.stack(w2).cuda())
    return up, down, dense


def _route(m: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    weights, ids = route(torch.randn(m, E, generator=g, device="cuda"), K, True)
    return x, weights, ids


@pytest.mark.parametrize("m", [1, 12, 16, 96])  # 8 and 96 pairs: the GEMVs (pair_limit 101); 128, 768: dequantized
def test_stacked_experts_equal_the_plain_loop_and_replay_in_a_graph(experts, m):
    up, down, (w13, w2) = experts
    x, weights, ids = _route(m, m)
    run = lambda: experts_stacked(x, up, down, weights, ids, fused_moe.fused_experts)  # noqa: E731
    got = run()
    want = experts_plain(x.float(), w13, w2, weights, ids)
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() < 2e-2 * scale  # bf16 activations and outputs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    ids.copy_(torch.roll(ids, 1, dims=0))  # every token on another token's experts
    graph.replay()
    torch.testing.assert_close(captured, run(), rtol=0, atol=0)


def test_batch_one_time(experts):
    """Informational: one layer's experts for one token, GGUF blocks against bf16 (fused_moe's GEMV)."""
    up, down, (w13, w2) = experts
    x, weights, ids = _route(1, 0)
    w13b, w2b = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    for name, fn in (("gguf Q4_K/Q5_0", lambda: experts_stacked(x, up, down, weights, ids, fused_moe.fused_experts)),
                     ("bf16", lambda: fused_moe.fused_experts(x, w13b, w2b, weights, ids))):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"\n{name}: {start.elapsed_time(end) / 200 * 1000:.1f} us per layer's experts, 1 token, top {K} of {E}")
