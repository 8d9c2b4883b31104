"""A 16-bit model on nanoplug computes closer to float32 than transformers in the same dtype: its residual stream
stays float32 (`residual_stream`) and its logits are float32 (`LinearMethod.apply_float32`), where transformers
rounds both to bf16. On CPU, on tiny random checkpoints written in bf16 (so that the weights are exact in both
dtypes, as a real bf16 checkpoint's are): the stream between layers and the logits are float32, and where those
roundings are a visible part of bf16's error (the Llama-style decoders; a tiny Gemma-3's error is its other
roundings'), the log-probabilities of every prompt position are nearer transformers-in-float32's than
transformers-in-bf16's are. The real-weight figures on the GPU: benchmarks/RESULTS.md, Quality."""
from __future__ import annotations

import pytest
import torch

from _checkpoints import CHECKPOINTS, PROMPTS, prompt_ids, prompt_logprobs, scratch_dir


@pytest.mark.parametrize("name,bar", [("qwen3", 0.8), ("qwen2", 0.8), ("gemma3", None)])
def test_bf16_keeps_a_float32_stream_and_float32_logits(name, bar):
    from transformers import AutoModelForCausalLM

    from nanoplug import LLM
    from nanoplug.bench.checkpoints import write_random_checkpoint

    architecture, shape = CHECKPOINTS[name]
    folder = str(write_random_checkpoint(scratch_dir(f"{name}-bf16"), architecture, dtype=torch.bfloat16, **shape))
    ids = sum(prompt_ids(name, PROMPTS), [])
    llm = LLM(folder, dtype="bfloat16", device="cpu", max_model_len=256)
    try:
        model, streams = llm.engine.worker.model, []
        at = 2 if name != "gemma3" else 1  # (positions, hidden, residual) or Gemma's (positions, stream, dtype)
        hook = model.model.layers[1].register_forward_pre_hook(lambda m, args: streams.append(args[at].dtype))
        ours = prompt_logprobs(llm, ids)
        hook.remove()
        with torch.inference_mode():
            logits = model.compute_logits(torch.zeros(1, shape.get("hidden_size", 64), dtype=torch.bfloat16))
    finally:
        llm.close()
    assert streams and set(streams) == {torch.float32} and logits.dtype == torch.float32
    if bar is None:
        return
    rows = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
            rows[dtype] = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), -1)
    want = rows[torch.float32]
    err_ours, err_theirs = (ours - want).abs().mean().item(), (rows[torch.bfloat16] - want).abs().mean().item()
    print(f"{name}: mean |log p - float32's|: nanoplug bf16 {err_ours:.2e}, transformers bf16 {err_theirs:.2e}")
    assert err_ours < bar * err_theirs, (err_ours, err_theirs)


def test_wide_linear_off_cuda_widens_the_weight_a_slice_at_a_time():
    """The CPU way of `wide_linear`: a weight of rows no multiple of the slice, leading dims kept, float32 out equal
    to the product of the widened operands."""
    from nanoplug.api import linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2 * linear.WIDEN_ROWS + 37, 48, generator=gen).bfloat16()
    x = torch.randn(2, 3, 48, generator=gen).bfloat16()
    got = linear.wide_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (2, 3, w.shape[0])
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w.float()), rtol=1e-6, atol=1e-6)
