"""A row's product does not depend on the rows beside it (issue 37): the small-GEMM kernel's rows of an M-row
product are bit-equal to each row computed alone, for every M up to a verification's rows, on small decoder
weight shapes (SmolLM2-135M's), with bias and float32 output; and so, in bf16, a speculative engine's
verification rows compute what one-row decode steps compute: at batch 1 its greedy tokens are the plain
engine's, and their log-probabilities too (within float32 noise: the LM head's float32 logits of several rows
are cuBLAS's). Without the rule (cuBLAS for a verification's rows) the second test fails on an H100: a
log-probability 3.3e-4 off.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_row_invariance.py`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _checkpoints import PROMPTS, checkpoint  # noqa: E402
from test_spec_decode import REPEATING, oracle, registry_with  # noqa: E402
from nanoplug import LLM, SamplingParams  # noqa: E402
from nanoplug.kernels.cuda import small_gemm  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536), (1024, 3072), (512, 5000)])
def test_each_row_equals_itself_alone(dtype, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype)
    verify = small_gemm.MAX_VERIFY_ROWS
    x = torch.randn(verify, k, device="cuda", generator=gen).to(dtype)
    for rows in range(1, verify + 1):
        assert small_gemm.takes(x[:rows], w, b, verify), rows
        for bias, out_dtype in ((None, None), (b, None), (None, torch.float32)):
            together = small_gemm.linear(x[:rows], w, bias, out_dtype, verify)
            alone = torch.cat([small_gemm.linear(x[i:i + 1], w, bias, out_dtype) for i in range(rows)])
            assert torch.equal(together, alone), (rows, bias is not None, out_dtype)


def test_verification_rows_equal_one_row_decode_steps():
    """Batch 1, greedy, 4 drafts a step (an oracle's, the fourth wrong: 5 rows, the graph of 8): the plain
    engine's tokens and log-probabilities, one prompt at a time."""
    options = dict(device="cuda", dtype="bfloat16", kv_block_size=16, max_model_len=128, max_num_seqs=4,
                   attention="flash")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    plain = LLM(checkpoint(), cuda={"memory_utilization": 0.3}, **options)
    prompts = [plain.engine.make_request(p).prompt_token_ids for p in PROMPTS[:3]] + REPEATING[:1]
    want = [plain.generate([p], params, use_tqdm=False)[0] for p in prompts]
    plain.close()
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, want)}
    spec = LLM(checkpoint(), registry=registry_with("oracle", oracle(reference)), speculator="oracle",
               num_speculative_tokens=4, adaptive_speculation=False, cuda={"memory_utilization": 0.6}, **options)
    spec.engine.speculation.speculator.wrong_at = 3
    got = [spec.generate([p], params, use_tqdm=False)[0] for p in prompts]
    stats = spec.engine.speculation.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    spec.close()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close([t.logprob for t in g.logprobs], [t.logprob for t in w.logprobs], rtol=0,
                                   atol=2e-5)
