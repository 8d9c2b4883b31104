"""Speculative decoding on CUDA: greedy output with drafts (an oracle speculator that proposes the right tokens with
one wrong in each proposal, and ngram) equals the plain engine's through `flash` and `triton`, and the verification
steps (k + 1 one-token decode rows per sequence) replay the captured decode graphs.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_spec_decode.py`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _checkpoints import PROMPTS, checkpoint  # noqa: E402
from test_spec_decode import REPEATING, assert_same, oracle, registry_with  # noqa: E402
from nanoplug import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
OPTIONS = dict(device="cuda", dtype="bfloat16", kv_block_size=16, max_model_len=128, max_num_seqs=16)
# three engines live at once; memory_utilization caps the process's whole use, so each next one is given more
SHARES = [{"memory_utilization": 0.3}, {"memory_utilization": 0.6}, {"memory_utilization": 0.9}]


@pytest.mark.parametrize("attention", ["flash", "triton"])
def test_greedy_with_drafts_equals_plain_under_graphs(attention):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    plain = LLM(checkpoint(), attention=attention, cuda=SHARES[0], **OPTIONS)
    prompts = [plain.engine.make_request(p).prompt_token_ids for p in PROMPTS] + REPEATING
    want = plain.generate(prompts, params, use_tqdm=False)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, want)}
    llm = LLM(checkpoint(), registry=registry_with("oracle", oracle(reference)), speculator="oracle",
              num_speculative_tokens=3, adaptive_speculation=False, attention=attention, cuda=SHARES[1], **OPTIONS)
    llm.engine.speculation.speculator.wrong_at = 2
    before = llm.engine.worker.report().stats.graph_replays
    assert_same(want, llm.generate(prompts, params, use_tqdm=False))
    stats = llm.engine.speculation.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert llm.engine.worker.report().stats.graph_replays > before  # 7 sequences x 4 rows fit the captured sizes
    ngram = LLM(checkpoint(), speculator="ngram", attention=attention, cuda=SHARES[2], **OPTIONS)
    assert_same(want, ngram.generate(prompts, params, use_tqdm=False))
    torch.cuda.synchronize()
    for engine in (plain, llm, ngram):  # the next backend's engines size their caches from what is left
        engine.close()
