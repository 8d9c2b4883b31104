"""The Triton GGUF kernels (kernels/gguf/) and the `gguf_triton` weight format, on CPU
through the Triton interpreter (TRITON_INTERPRET=1 must be set before the kernels are defined, so the
module is reloaded after setting it, whatever another test imported first), against references no one
here wrote:

- every dequantized tensor (whole, or rows gathered by id as the embedding does) equals gguf-py's
  `gguf.quants.dequantize` bit for bit, for Q8_0, Q4_0, Q4_1 and Q4_K;
- each product (the GEMV for one or two rows, dequantize + GEMM for more) equals
  float64 dequantize-then-matmul within float32 rounding (1e-5 of sum |x| |w|); the GEMV on int8
  activations equals the product with activations rounded to int8 a group within float32 rounding, and
  the exact product within that rounding's bound;
- an engine on a small Qwen3 GGUF mixing every format (a fused qkv of three, a quantized tied embedding)
  through the Triton path gives the float32 engine's greedy tokens on gguf-py's dequantized weights,
  and its log-probabilities within float32 rounding.
"""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import nanoplug.kernels.gguf.triton_kernels as kernels  # noqa: E402
from _checkpoints import prompt_logprobs  # noqa: E402
from nanoplug.bench.checkpoints import quantize_q4_k, write_gguf, write_random_checkpoint  # noqa: E402
from nanoplug.kernels.gguf.blocks import FORMATS, repack  # noqa: E402

kernels = importlib.reload(kernels)
ROWS, COLS = 37, 768  # rows not a multiple of any block; 24 groups of 32, 3 Q4_K super-blocks
MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q4_1",
         "ffn_up": "Q8_0", "ffn_down": "Q4_K", "token_embd": "Q8_0"}
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
             tie_word_embeddings=True)


def quantized(fmt: str, rows: int = ROWS, cols: int = COLS, seed: int = 0):
    """gguf-py's blocks of a random weight, and gguf-py's dequantization of them."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = quantize_q4_k(w) if fmt == "Q4_K" else gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[fmt]).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_gguf_py(fmt):
    blocks, ref = quantized(fmt)
    packed = repack(fmt, blocks, ROWS, COLS)
    assert torch.equal(kernels.dequantize(packed, torch.empty(ROWS, COLS)), ref)
    ids = torch.tensor([5, 0, 36, 5, 17])
    assert torch.equal(kernels.dequantize(packed, torch.empty(len(ids), COLS), ids), ref[ids])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 7, 70])  # the GEMV (one and two rows), dequantize + mm
def test_matmul_equals_dequantize_then_matmul(fmt, m):
    blocks, ref = quantized(fmt, seed=1)
    packed = repack(fmt, blocks, ROWS, COLS)
    x = torch.randn(m, COLS, generator=torch.Generator().manual_seed(2))
    got = kernels.linear(x, packed, torch.empty(m, ROWS))
    exact = x.double() @ ref.double().T
    bound = 1e-5 * (x.double().abs() @ ref.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all(), (got.double() - exact).abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("int8", [False, True])
def test_the_experts_gemv_equals_each_experts_own(fmt, int8):
    """Three experts' blocks stacked into one weight: each (token, slot) pair's row, reading its expert by id on the
    device, has the bits of that expert's own GEMV on its token (x_div: the pairs of one token share its row)."""
    experts = [quantized(fmt, seed=seed)[0] for seed in (5, 6, 7)]
    stacked = repack(fmt, torch.cat(experts), 3 * ROWS, COLS)
    config = kernels.GemvConfig(16, 16, 4, int8=int8)
    x = torch.randn(2, COLS, generator=torch.Generator().manual_seed(8))
    ids = torch.tensor([2, 0, 1, 2])  # token 0 takes experts 2 and 0, token 1 experts 1 and 2
    got = kernels.gemv(x, stacked, torch.empty(4, ROWS), config, experts=(ids, 2))
    for pair, expert in enumerate(ids.tolist()):
        own = repack(fmt, experts[expert], ROWS, COLS)
        assert torch.equal(got[pair], kernels.gemv(x[pair // 2:pair // 2 + 1], own, torch.empty(1, ROWS), config)[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_with_its_loop_unrolled_equals_the_plain_loop(fmt):
    """The GEMV whose K loop is unrolled at compile time adds the same terms in the same order: the same
    bits (24 groups in chunks of 16: a ragged last chunk)."""
    blocks, _ = quantized(fmt, seed=4)
    packed = repack(fmt, blocks, ROWS, COLS)
    x = torch.randn(2, COLS, generator=torch.Generator().manual_seed(5))
    plain, unrolled = (kernels.gemv(x, packed, torch.empty(2, ROWS), kernels.GemvConfig(16, 16, 4, u))
                       for u in (False, True))
    assert torch.equal(plain, unrolled)


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_gemv_is_the_product_with_activations_rounded_to_int8(fmt):
    """The GEMV on int8 activations (the plain emulation of dp4a here) equals the dequantized weights times
    the activations rounded to int8 a group of 32 (scale: the group's largest |x| / 127) within float32
    rounding, and the exact product within the rounding's own bound, sum |w| d_x / 2; unrolling the K loop
    changes no bit."""
    blocks, ref = quantized(fmt, seed=6)
    packed = repack(fmt, blocks, ROWS, COLS)
    x = torch.randn(2, COLS, generator=torch.Generator().manual_seed(7))
    plain, unrolled = (kernels.gemv(x, packed, torch.empty(2, ROWS), kernels.GemvConfig(16, 16, 4, u, int8=True))
                       for u in (False, True))
    assert torch.equal(plain, unrolled)
    groups = x.double().view(2, -1, 32)
    dx = groups.abs().amax(-1, keepdim=True) / 127
    x8 = (torch.round(groups / dx) * dx).view(2, COLS)
    w = ref.double()
    rounding = 1e-5 * (x.double().abs() @ w.abs().T)
    assert ((plain.double() - x8 @ w.T).abs() <= rounding).all()
    bound = (dx.expand(-1, -1, 32).reshape(2, COLS) / 2) @ w.abs().T + rounding
    assert ((plain.double() - x.double() @ w.T).abs() <= bound).all()


def test_writes_into_columns_of_a_wider_output():
    """A fused layer's parts write their own columns of one output (rows strided)."""
    blocks, _ = quantized("Q4_1")
    packed = repack("Q4_1", blocks, ROWS, COLS)
    for m in (1, 2, 5):
        x = torch.randn(m, COLS)
        out = torch.full((m, ROWS + 10), 7.0)
        kernels.linear(x, packed, out[:, 4:4 + ROWS])
        assert torch.equal(out[:, 4:4 + ROWS], kernels.linear(x, packed, torch.empty(m, ROWS)))
        assert (out[:, :4] == 7).all() and (out[:, 4 + ROWS:] == 7).all()


# ------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-triton")
    checkpoint = write_random_checkpoint(folder / "q3", **SHAPE)
    return write_gguf(checkpoint, folder / "mixed.gguf", formats=MIXED)


def test_engine_on_the_triton_path_matches_the_float32_engine(mixed_gguf):
    from nanoplug import LLM, SamplingParams

    options = dict(device="cpu", dtype="float32", kv_block_size=16, max_model_len=256, cpu={"kv_cache_gb": 0.05},
                   enable_prefix_caching=False)
    quant = LLM(str(mixed_gguf), quantization="gguf_triton", **options)
    dense = LLM(str(mixed_gguf), quantization=None, **options)
    try:
        assert quant.choices["weight_format"].name == "gguf_triton" and dense.choices["weight_format"].name == "dense"
        model = quant.engine.worker.model
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied head shares the blocks
        qkv = model.model.layers[0].self_attn.qkv_proj.weight.gguf.segments
        assert [s.weight.fmt for s in qkv] == ["Q4_0", "Q4_1", "Q8_0"]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for prompt in ["The capital of France is", "def fibonacci(n):"]:
            got = quant.generate([prompt], params, use_tqdm=False)[0].token_ids
            want = dense.generate([prompt], params, use_tqdm=False)[0].token_ids
            assert got == want, prompt
        ids = dense.tokenizer.encode("Once upon a time, in a small village, there lived")
        diff = (prompt_logprobs(quant, ids) - prompt_logprobs(dense, ids)).abs().max().item()
        assert diff < 1e-4, diff
    finally:
        quant.close()
        dense.close()


def _gguf_tensor(fmt: str, rows: int, cols: int, seed: int):
    from nanoplug.checkpoint.gguf_file import GGUFTensor

    blocks, ref = quantized(fmt, rows, cols, seed)
    kind = gguf.GGMLQuantizationType[fmt]
    return GGUFTensor("w", "w", int(kind), fmt, (rows, cols), blocks.numpy()), ref


@pytest.mark.parametrize("up_fmt", ["Q4_K", "Q8_0"])  # gate in Q4_K too: stacked in their blocks; else dense
def test_stacked_experts_equal_the_plain_loop_on_gguf_pys_weights(up_fmt):
    """An MoE's experts loaded a (expert, part) at a time, as the checkpoint has them: one format stays stacked in
    its blocks, parts in two are held dense; every path (a GEMV per pair for up to E pairs, the batched matmuls on
    the dequantized experts for more) equals the plain loop over gguf-py's dequantized weights."""
    from nanoplug.api.layers.moe import experts_batched, experts_plain, experts_stacked
    from nanoplug.kernels.gguf.triton_experts import StackedGGUFExperts

    e, hidden, inter = 4, 256, 256  # (a Q4_K row holds super-blocks of 256)
    up = StackedGGUFExperts(e, 2 * inter, hidden, 2, torch.float32, None)
    down = StackedGGUFExperts(e, hidden, inter, 1, torch.float32, None)
    w13, w2 = [], []
    for expert in range(e):
        for part, fmt in enumerate(("Q4_K", up_fmt)):
            t, ref = _gguf_tensor(fmt, inter, hidden, seed=10 * expert + part)
            up.weight_loader(up.weight, t, (expert, part))
            w13.append(ref)
        t, ref = _gguf_tensor("Q4_K", hidden, inter, seed=10 * expert + 5)
        down.weight_loader(down.weight, t, expert)
        w2.append(ref)
    up.finish()
    down.finish()
    assert up.quantized == (up_fmt == "Q4_K") and down.quantized
    w13, w2 = torch.cat(w13).view(e, 2 * inter, hidden), torch.stack(w2)
    assert torch.equal(up.dense(torch.float32), w13) and torch.equal(down.dense(torch.float32), w2)
    assert up.pair_limit == (46 if up.quantized else e) and down.pair_limit == 46  # 4 * (1 + 8 / 0.75): Q4_K split
    # into 4-bit quants and float32 scales and mins, 0.75 bytes a weight
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(24, hidden, generator=gen)
    weights, ids = torch.rand(24, 2, generator=gen), torch.randint(0, e, (24, 2), generator=gen)
    for tokens in (23, 24):  # 46 pairs (the GEMVs where quantized), 48 (dequantized)
        got = experts_stacked(x[:tokens], up, down, weights[:tokens], ids[:tokens], experts_batched)
        want = experts_plain(x[:tokens], w13, w2, weights[:tokens], ids[:tokens])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())  # float32 sums
