"""The fp8 KV cache on CUDA in bfloat16: the quantizing store against PyTorch's float8 rounding (bit-exact),
`nanoplug compare`'s scenario through `flash` and `triton` over an fp8 cache against `manual` over one, and
decode under CUDA graphs against eager. The decode kernel itself: test_gpu_decode_kernel.py.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_fp8_kv.py`."""
from __future__ import annotations

import pytest
import torch

from nanoplug.api import KVLayer
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.cli import compare
from nanoplug.kernels.attention.rotated_cache import RotatedKVLayer
from nanoplug.plugins.kv_cache import fp8

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128)
CASES = ("prefill", "decode", "prefix-hit", "chunked", "decode-mixed")


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_store_kernel_exact(scales):
    torch.manual_seed(0)
    n, heads, dim = 300, 8, 128
    qkv = torch.randn(n, 32 * dim, device="cuda", dtype=torch.bfloat16) * 60  # some saturate
    k = qkv[:, 16 * dim:24 * dim].view(n, heads, dim)
    v = qkv[:, 24 * dim:].view(n, heads, dim)
    slots = torch.randperm(40 * 16, device="cuda")[:n]
    slots[::7] = -1
    kc = torch.randn(40, 16, heads, dim, device="cuda").to(FP8)
    vc = kc.clone()
    rk, rv = kc.clone(), vc.clone()
    keep = slots >= 0
    layer = KVLayer(0, torch.tensor(scales[0], device="cuda"), torch.tensor(scales[1], device="cuda"))
    bits = torch.uint8  # indexing through an integer view: float8 kernels are few
    rk.view(bits).view(-1, heads, dim)[slots[keep]] = fp8.quantize_reference(k[keep], layer.k_scale).view(bits)
    rv.view(bits).view(-1, heads, dim)[slots[keep]] = fp8.quantize_reference(v[keep], layer.v_scale).view(bits)
    fp8.Fp8Store().store(k, v, kc, vc, slots, layer)
    torch.cuda.synchronize()
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


@pytest.mark.parametrize("rotated", [True, False])
def test_prefill_page_gather_kernel_equals_index_select_then_dequantize(rotated):
    """`flash`'s prefill over cached context reads a float8 cache's pages through one kernel a layer (scaled,
    turned back, tensor-core dots in bfloat16): the plain way's result to a bfloat16 rounding."""
    from nanoplug.api import AttentionMetadata
    from nanoplug.kernels.attention.dequantized_pages import DequantizedPages

    torch.manual_seed(0)
    page, heads, dim = 256, 8, 128
    kc = (torch.randn(30, page, heads, dim, device="cuda") * 3).to(FP8)
    vc = (torch.randn(30, page, heads, dim, device="cuda") * 3).to(FP8)
    rot = fp8.hadamard(dim).to("cuda", torch.bfloat16) if rotated else None
    layer = RotatedKVLayer(0, torch.tensor(0.8, device="cuda"), torch.tensor(1.7, device="cuda"), rot) if rotated \
        else KVLayer(0, torch.tensor(0.8, device="cuda"), torch.tensor(1.7, device="cuda"))
    tables = torch.randperm(29, device="cuda")[:24].to(torch.int32).view(4, 6)
    lens = torch.tensor([1500, 300, 700, 1536], dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(is_prefill=True, cu_seqlens_q=torch.arange(5, dtype=torch.int32, device="cuda"),
                             cu_seqlens_k=torch.cumsum(torch.cat([lens.new_zeros(1), lens]), 0).int(), seq_lens=lens,
                             slot_mapping=lens.long(), block_tables=tables, max_seqlen_q=1, max_seqlen_k=1536)
    pages = DequantizedPages()
    pages.prepare(meta, page)
    k, v, _ = pages.gather(kc, vc, layer, torch.bfloat16)
    ref_k, ref_v = pages.gather_plain(kc, vc, layer, torch.bfloat16)
    torch.testing.assert_close(k, ref_k, rtol=2 ** -7, atol=2e-3)  # near 0: the dots add in another order
    torch.testing.assert_close(v, ref_v, rtol=2 ** -7, atol=2e-3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_random_checkpoint(tmp_path_factory.mktemp("gpu-fp8") / "q3", **GPU_SHAPE))


@pytest.fixture(scope="module")
def fp8_reference(model):
    outcome = compare.run_backend(model, "manual", device="cuda", dtype="bfloat16", kv_cache="fp8",
                                  cuda={"enforce_eager": True})
    assert outcome.error is None, outcome.error
    return outcome


@pytest.mark.parametrize("name", ["flash", "triton"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_backends_over_fp8_cache_match_manual(model, fp8_reference, name, eager):
    outcome = compare.run_backend(model, name, device="cuda", dtype="bfloat16", kv_cache="fp8",
                                  cuda={"enforce_eager": eager})
    if name == "flash" and outcome.error and "pip install flash-attn" in outcome.error:
        pytest.skip("no FlashAttention build here")
    assert outcome.error is None, outcome.error
    diffs = compare.differences(outcome, fp8_reference)
    assert set(diffs) == set(CASES)
    for case, (abs_diff, rel_diff) in diffs.items():
        # bf16 attention against manual's float32 over the same float8 values (measured up to 2.1e-2 where
        # a prefix hit reads them back through bf16 pages)
        assert rel_diff < 2.5e-2, (name, case, abs_diff, rel_diff)


@pytest.mark.parametrize("attention", ["flash", "triton"])
def test_engine_fp8_graphs_equal_eager(model, attention):
    from nanoplug import LLM, SamplingParams
    from nanoplug.errors import NanoplugError

    from _checkpoints import relative_error

    prompts = [f"Story {i}: " + "once upon a time " * (3 + 7 * i) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_logits=True)
    outs = {}
    for eager in (True, False):
        try:
            llm = LLM(model, attention=attention, kv_cache="fp8", dtype="bfloat16", max_model_len=1024,
                      cuda={"enforce_eager": eager})
        except NanoplugError as exc:
            if attention == "flash" and "pip install flash-attn" in str(exc):
                pytest.skip("no FlashAttention build here")
            raise
        assert llm.engine.worker.kv_cache.dtype == FP8
        assert (llm.engine.worker.graphs is None) == eager  # graphs captured, not fallen back to eager
        outs[eager] = llm.generate(prompts, params, use_tqdm=False)
        llm.close()
    # a graph's grid splits contexts for the model's limit, eager's for the step's: sums in another order,
    # and this random model's near ties may then flip a greedy token, after which the inputs differ. So
    # the logits are compared position by position up to where the tokens part, to the bf16 tolerance.
    compared = 0
    for a, b in zip(outs[True], outs[False]):
        for i, (la, lb) in enumerate(zip(a.logits, b.logits)):
            if a.token_ids[:i] != b.token_ids[:i]:
                break
            assert relative_error(lb.float(), la.float()) < 2.5e-2, (i, a.token_ids, b.token_ids)
            compared += 1
    assert compared >= len(prompts) * 12, compared
