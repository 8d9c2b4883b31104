"""Penalties, logit bias, logprobs and n on CUDA: the sampler's extra work never makes the host wait
for the device (torch's sync debug mode turns any synchronizing call into an error), and the engine
on CUDA (overlapped steps, with and without graphs) gives the CPU engine's tokens (a seeded request: its own tokens
when sent alone) and transformers' logprobs on the same float32 checkpoint.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_sampling.py`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared helpers in tests/

from _checkpoints import PROMPTS, checkpoint, hf_logits, prompt_ids  # noqa: E402
from nanoplug import LLM, SamplingParams  # noqa: E402
from nanoplug.api import LogitsProcessingBatch, SamplingBatch, SlotInit  # noqa: E402
from nanoplug.engine.penalties import add_sample_row  # noqa: E402
from nanoplug.worker.sampler import Sampler  # noqa: E402

pytestmark = pytest.mark.gpu
OPTIONS = dict(kv_block_size=16, num_kv_blocks=64, max_model_len=256, dtype="float32")
PARAMS = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, repetition_penalty=1.5),
    SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=1, frequency_penalty=0.8),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={13: 6.0}, presence_penalty=1.0,
                   prompt_logprobs=2),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
]


@pytest.fixture(scope="module")
def cpu_outputs():
    with LLM(checkpoint(), device="cpu", **OPTIONS) as llm:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def test_penalties_bias_and_logprobs_never_sync_the_host():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    dev = torch.device("cuda")
    sampler = Sampler(dev)
    logits = torch.randn(4, 1000, device=dev)
    processing = LogitsProcessingBatch(inits=[SlotInit(0, [1, 2, 3], []), SlotInit(1, [4], [5, 5])])
    add_sample_row(processing, 0, SamplingParams(repetition_penalty=1.3, logit_bias={7: 2.0}), 0)
    add_sample_row(processing, 2, SamplingParams(frequency_penalty=0.5), 1)
    add_sample_row(processing, 3, SamplingParams(logit_bias={9: -100.0}), None)
    batch = SamplingBatch([0.0, 0.9, 0.7, 0.0], [0, 40, 0, 0], [1.0, 0.9, 1.0, 1.0], [0.0] * 4, [None] * 4, [3] * 4,
                          processing=processing, logprob_rows=[0, 2, 3], num_top_logprobs=[5, 0, 2])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # slots filled, then counted into, step after step
            tokens = sampler(logits, batch)
            packed = sampler.logprobs(logits, tokens, batch).pack().to("cpu", non_blocking=True)
            processing.inits = []
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert packed.numel() == 2 * 3 * (1 + 5)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_engine_matches_the_cpu_engine_and_transformers(cpu_outputs, eager):
    with LLM(checkpoint(), device="cuda", cuda={"enforce_eager": eager}, **OPTIONS) as llm:
        assert llm.engine.overlap  # CUDA overlaps steps by default: counts and forks with pending tokens
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        # a seed's noise is drawn by the device's own generator (the CPU's draws other numbers): a seeded request
        # gets the same tokens on this device whatever else is in the batch
        alone = {i: llm.generate([PROMPTS[i]], PARAMS[i], use_tqdm=False)[0]
                 for i, p in enumerate(PARAMS) if p.seed is not None}
    for i, (ids, cpu, gpu) in enumerate(zip(prompt_ids(), cpu_outputs, outs)):
        same = alone[i] if i in alone else cpu
        assert [o.token_ids for o in gpu.outputs] == [o.token_ids for o in same.outputs], i
        for sample in gpu.outputs:
            if sample.logprobs is None:
                continue
            want = torch.log_softmax(hf_logits("qwen3", ids + sample.token_ids).double(), dim=-1)
            got = torch.tensor([lp.logprob for lp in sample.logprobs], dtype=torch.float64)
            rows = want[len(ids) - 1:-1].gather(1, torch.tensor(sample.token_ids).view(-1, 1)).squeeze(1)
            torch.testing.assert_close(got, rows, rtol=0, atol=1e-3)
    assert outs[2].prompt_logprobs is not None and len(outs[2].prompt_logprobs) == len(prompt_ids()[2])


def test_the_temperature_kernel_draws_from_softmax_and_never_syncs():
    """The cuda platform's one-pass temperature sampler on a full Qwen3 vocabulary: the frequencies of 20,000
    draws (bf16 logits, mass spread over a few tokens and a long tail) follow softmax(logits / T), and a
    temperature-only batch through the engine's Sampler makes the host wait for nothing."""
    from nanoplug.kernels.cuda import sampling as sampling_kernel

    dev, vocab, rows, temperature = torch.device("cuda"), 151936, 20000, 0.6
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 2
    base[[5, 77_000, vocab - 1]] = torch.tensor([9.0, 8.5, 8.0])
    logits = base.to(dev, torch.bfloat16).expand(rows, vocab)
    tokens = sampling_kernel.sample(logits, torch.full((rows,), temperature, device=dev), seed=99)
    want = torch.softmax(base.to(torch.bfloat16).double() / temperature, dim=-1)
    top = [5, 77_000, vocab - 1]
    freq = torch.bincount(tokens.cpu(), minlength=vocab).double() / rows
    sigma = (want[top] * (1 - want[top]) / rows).sqrt()
    assert ((freq[top] - want[top]).abs() <= 4.5 * sigma).all(), (freq[top], want[top])
    tail = 1 - want[top].sum()
    assert abs((1 - freq[top].sum()) - tail) <= 4.5 * float((tail * (1 - tail) / rows).sqrt()) + 1e-4

    sampler = Sampler(dev, temperature=sampling_kernel.sample)
    batch = SamplingBatch([0.8, 0.0, 1.1], [0] * 3, [1.0] * 3, [0.0] * 3, [None] * 3, [3] * 3)
    small = torch.randn(3, vocab, device=dev, dtype=torch.bfloat16)
    out = _without_sync(sampler, small, batch)
    assert int(out[1]) == int(small[1].float().argmax())


def test_the_masked_temperature_kernel_draws_what_the_plain_mask_and_draw_do_and_never_syncs():
    """Structured outputs' one-pass draw (`sample_masked`) on a full Qwen3 vocabulary at batch 64, bf16: exactly the
    tokens of the temperature kernel over the logits masked by the plain path, some rows greedy, every row or some
    rows masked; through the engine's Sampler (pinned bitmask, the one-pass path) the host waits for nothing."""
    import numpy as np

    from nanoplug.api.step import host_array
    from nanoplug.kernels.cuda import sampling as sampling_kernel

    dev, vocab, rows = torch.device("cuda"), 151936, 64
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dev, torch.bfloat16)
    allowed = torch.rand(rows, (vocab + 31) // 32 * 32, generator=g) < 0.3
    allowed[:, vocab:] = False
    packed = torch.from_numpy(np.packbits(allowed.numpy(), axis=1, bitorder="little").view(np.int32).copy())
    temps = torch.tensor([0.0 if r % 5 == 0 else 0.8 for r in range(rows)], device=dev)
    for masked_rows in (list(range(rows)), list(range(0, rows, 3))):
        batch = SamplingBatch.greedy(rows)
        batch.mask_rows, batch.bitmask = masked_rows, packed[:len(masked_rows)]
        plain = Sampler(dev).masked(logits, batch)
        of = [-1] * rows
        for i, row in enumerate(masked_rows):
            of[row] = i
        where = None if len(masked_rows) == rows else torch.tensor(of, dtype=torch.int32, device=dev)
        got = sampling_kernel.sample_masked(logits, temps, 17, batch.bitmask.to(dev), where)
        assert torch.equal(got, sampling_kernel.sample(plain, temps, 17))
        assert bool((plain.gather(1, got[:, None]) > float("-inf")).all())

    sampler = Sampler(dev, temperature=sampling_kernel.sample, grammar_draw=sampling_kernel.sample_masked)
    batch = SamplingBatch([0.8] * rows, [0] * rows, [1.0] * rows, [0.0] * rows, [None] * rows, [3] * rows)
    bitmask = host_array(tuple(packed.shape), torch.int32, dev)
    bitmask[:] = packed.numpy()
    batch.mask_rows, batch.bitmask = list(range(rows)), bitmask
    out = _without_sync(sampler, logits, batch)
    assert bool(allowed[torch.arange(rows), out.cpu()].all())


def _without_sync(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampler's tokens, any call that would make the host wait for the device an error meanwhile."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return sampler(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
