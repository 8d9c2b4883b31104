"""The MoE layer's fast paths against the plain one: the batched-matmul CPU path and the Triton grouped GEMM
(`nanoplug.kernels.moe.fused_moe`, under TRITON_INTERPRET=1), with experts dense and in fp8 with per-row scales,
the router against transformers' routers, and the router's one-launch kernel (`routing.py`) against it."""
from __future__ import annotations

import pytest
import torch

from _triton_interpreter import interpreted
from nanoplug.api.layers import experts_batched, experts_plain, route
from nanoplug.kernels.moe import fused_moe, routing

CASES = [  # tokens, experts, k, hidden, intermediate
    (1, 8, 2, 64, 32),
    (5, 8, 2, 64, 48),  # intermediate not a multiple of the block
    (37, 16, 4, 32, 32),  # blocks of several experts, some experts unused
]


def _inputs(t, e, k, h, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.1
    w2 = torch.randn(e, h, i, generator=g) * 0.1
    weights, ids = route(torch.randn(t, e, generator=g), k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("case", CASES)
def test_batched_equals_plain(case):
    x, w13, w2, weights, ids = _inputs(*case)
    want = experts_plain(x, w13, w2, weights, ids)
    assert torch.allclose(experts_batched(x, w13, w2, weights, ids), want, atol=1e-6, rtol=1e-5)
    assert experts_batched(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, x.shape[1])


def test_plain_equals_a_loop_over_tokens():
    """The reference itself, against the definition: sum_k w_k * down(silu(gate x) * up x) of each token."""
    x, w13, w2, weights, ids = _inputs(*CASES[1])
    want = torch.stack([
        sum(weights[t, j] * (w2[e] @ (torch.nn.functional.silu(w13[e, :w2.shape[2]] @ x[t]) * (w13[e, w2.shape[2]:] @ x[t])))
            for j, e in enumerate(ids[t].tolist()))
        for t in range(x.shape[0])])
    assert torch.allclose(experts_plain(x, w13, w2, weights, ids), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_equals_transformers_routers(renormalize):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(9, 16)
    qwen = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                             norm_topk_prob=renormalize))
    mixtral = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3))
    for router, renorm in ((qwen, renormalize), (mixtral, True)):
        torch.nn.init.normal_(router.weight)
        _, want_w, want_ids = router(x)
        weights, ids = route(x @ router.weight.T, 3, renorm)
        assert torch.equal(ids, want_ids)
        assert torch.allclose(weights, want_w.float(), atol=1e-7)


@pytest.mark.parametrize("renormalize", [False, True])
def test_triton_router_equals_route(renormalize):
    """The same experts in the same order and the same weights, in float32 and bfloat16 scores, for expert counts
    below and past a power of two; equal scores go to the lower id (where torch.topk promises no order, the
    kernel's own rule)."""
    g = torch.Generator().manual_seed(3)
    with interpreted(routing) as r:
        for t, e, k in ((1, 8, 2), (6, 60, 4), (3, 128, 8)):
            for dtype in (torch.float32, torch.bfloat16):
                logits = torch.randn(t, e, generator=g).to(dtype)
                assert r.takes(logits, k)
                want_w, want_ids = route(logits, k, renormalize)
                weights, ids = r.route(logits, k, renormalize)
                assert ids.dtype == torch.int64 and weights.dtype == torch.float32
                assert torch.equal(ids, want_ids), (t, e, k, dtype)
                assert torch.allclose(weights, want_w, atol=1e-7, rtol=1e-6)
        tied = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
        weights, ids = r.route(tied, 2, renormalize)
        assert ids.tolist() == [[1, 3]]
        want = torch.softmax(tied, -1)[0, [1, 3]]
        assert torch.allclose(weights[0], want / want.sum() if renormalize else want)
        assert r.route(tied[:0], 2, renormalize)[1].shape == (0, 2)
        columns = torch.randn(8, 3, generator=g).t()  # rows not contiguous: the plain route
        assert not r.takes(columns, 2) and torch.equal(r.route(columns, 2, renormalize)[1],
                                                       route(columns, 2, renormalize)[1])
        wide = torch.randn(2, routing.MAX_EXPERTS + 1, generator=g)
        assert not r.takes(wide, 2)  # one program holds a token's scores: past MAX_EXPERTS, the plain route
        assert torch.equal(r.route(wide, 2, renormalize)[1], route(wide, 2, renormalize)[1])


def test_install_fused_ops_gives_the_moe_block_the_router():
    """A platform's `FusedOps.route` reaches the MoE block (as the CUDA platform installs the kernel), which then
    computes what it computed with the plain router."""
    from nanoplug.api import FusedOps, install_fused_ops, rms_norm, silu_and_mul
    from nanoplug.api.layers import Layers, SparseMoeBlock
    from nanoplug.plugins.parallel.single import LocalGroup

    torch.manual_seed(4)
    block = SparseMoeBlock(Layers(LocalGroup()), 32, 16, 4, 24, renormalize=True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 32)
    want = block(x)
    calls = []
    with interpreted(routing) as r:
        def counted(*args):
            calls.append(args[1:])
            return r.route(*args)

        assert install_fused_ops(block, FusedOps(rms_norm, None, silu_and_mul, None, route=counted)) == 1
        got = block(x)
    assert calls == [(4, True)] and torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_align_block_size_groups_pairs_by_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]])
    sorted_ids, expert_ids, num_padded = fused_moe.align_block_size(ids, num_experts=5, block_m=4)
    pairs = ids.numel()
    assert int(num_padded) == 4 * 4  # experts 0, 1, 2, 3: one block each (expert 4 has none)
    blocks = sorted_ids[:16].view(4, 4)
    for block, expert in zip(blocks, expert_ids[:4].tolist()):
        real = block[block < pairs]
        assert real.numel() > 0 and (ids.flatten()[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # stable: in token order
    assert sorted(sorted_ids[sorted_ids < pairs].tolist()) == list(range(pairs))  # every pair once


@pytest.mark.parametrize("case", CASES)
def test_triton_grouped_gemm_equals_plain(case):
    x, w13, w2, weights, ids = _inputs(*case, seed=1)
    want = experts_plain(x, w13, w2, weights, ids)
    with interpreted(fused_moe) as fm:
        assert fm.takes(x, w13, w2)
        for cfg in (fm.SMALL_BATCH_CONFIG, dict(fm.DEFAULT_CONFIG, BLOCK_SIZE_M=16, GROUP_SIZE_M=2)):
            got = fm.fused_experts(x, w13, w2, weights, ids, config=cfg)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), cfg


@pytest.mark.parametrize("case", CASES)
def test_triton_gemv_path_equals_plain(case):
    x, w13, w2, weights, ids = _inputs(*case, seed=2)
    want = experts_plain(x, w13, w2, weights, ids)
    with interpreted(fused_moe) as fm:
        small = dict(fm.GEMV_CONFIG, UP_BLOCK_N=4, UP_BLOCK_K=16, DOWN_BLOCK_N=8, DOWN_BLOCK_K=32)  # K steps
        for cfg in (fm.GEMV_CONFIG, small):  # past the rows and the columns (48 and 64 are not multiples)
            got = fm.experts_gemv(x, w13, w2, weights, ids, config=cfg)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), cfg
        if case[0] <= fm.GEMV_TOKENS:  # a decode step's few tokens take it by default
            assert torch.allclose(fm.fused_experts(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_h200_configs_are_read():
    table = fused_moe._configs(128, 768, "NVIDIA H200")
    assert table and {1, 64, 256} <= set(table)
    assert all(set(c) == set(fused_moe.DEFAULT_CONFIG) for c in table.values())


def _fp8_experts(w13, w2):
    """Each expert quantized per row as the fp8 format does on load: (w13 values, w2 values, (scales, scales))."""
    from nanoplug.plugins.weight_formats.fp8 import quantize_rows

    (q13, s13), (q2, s2) = quantize_rows(w13), quantize_rows(w2)
    q, s = quantize_rows(w13[1])  # stacked or one expert at a time (as the loader does): the same values
    assert torch.equal(q13[1].float(), q.float()) and torch.equal(s13[1], s)
    return q13, q2, (s13, s2)


@pytest.mark.parametrize("case", CASES)
def test_fp8_experts_every_path_equals_plain_over_their_dequantization(case):
    """The kernels read e4m3 values and scale each output row after the sum: equal to the reference over the
    dequantized weights (float32 activations), and that reference is not the dense one (the values are coarse)."""
    x, w13, w2, weights, ids = _inputs(*case, seed=3)
    q13, q2, scales = _fp8_experts(w13, w2)
    want = experts_plain(x, q13, q2, weights, ids, scales=scales)
    assert not torch.allclose(want, experts_plain(x, w13, w2, weights, ids), atol=1e-4)
    assert torch.allclose(experts_batched(x, q13, q2, weights, ids, scales=scales), want, atol=1e-6, rtol=1e-5)
    with interpreted(fused_moe) as fm:
        assert fm.takes(x, q13, q2, scales) and not fm.takes(x, q13, q2)
        got = fm.fused_experts(x, q13, q2, weights, ids, config=fm.SMALL_BATCH_CONFIG, scales=scales)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        small = dict(fm.GEMV_CONFIG, UP_BLOCK_N=4, UP_BLOCK_K=16, DOWN_BLOCK_N=8, DOWN_BLOCK_K=32)
        got = fm.experts_gemv(x, q13, q2, weights, ids, config=small, scales=scales)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        if case[0] <= fm.FP8_GEMV_TOKENS:  # a decode step's few tokens take the GEMVs, in fp8's own block sizes
            got = fm.fused_experts(x, q13, q2, weights, ids, scales=scales)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
