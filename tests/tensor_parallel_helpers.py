"""Helpers for tests/test_tensor_parallel.py that must be importable in worker processes, and the
script each torchrun rank runs (`python -m torch.distributed.run ... tensor_parallel_helpers.py CKPT OUT`).

The faulty models are ordinary model plugins (registered under the Qwen3 architecture name in a
test's own Registry) that fail on rank 1 only, the way a real rank-local fault would.
"""
from __future__ import annotations

import sys

from nanoplug import hookimpl
from nanoplug.api import PLUGIN_API_VERSION, GraphCaptureError
from nanoplug.plugins.platforms.cpu.platform import CpuPlatform
from nanoplug.plugins.models.qwen3 import Qwen3ForCausalLM

FAIL_TOKEN = 4242  # a prompt holding this token id makes rank 1 fail in that step
SLOW_TOKEN, SLOW_S = 4243, 2.0  # a prompt holding this token id makes rank 1 sleep SLOW_S seconds in that step
FAIL_POSITION = 12  # SlowOrFailingOnRank1: rank 1 fails in the step that reaches this position (a decode)
PROMPT_PREFIX = ("You are a careful assistant. This shared system prompt starts every request and is long enough "
                 "to fill two whole KV blocks of sixteen tokens, so later requests reuse them: ")
PROMPTS = [PROMPT_PREFIX + "what is one plus one?", PROMPT_PREFIX + "name a colour.", "Hello"]
ENGINE_OPTIONS = dict(
    device="cpu", dtype="float32", attention="manual", kv_cache="torch", kv_block_size=16, num_kv_blocks=96,
    max_model_len=256, max_num_batched_tokens=24,  # prompts are longer: prefill is chunked
    enable_prefix_caching=True,
)


class InjectedFault(RuntimeError):
    pass


class FailsToLoadOnRank1(Qwen3ForCausalLM):
    def __init__(self, hf_config, layers, *args, **kwargs):
        if layers.group.rank == 1:
            raise InjectedFault("injected fault while building the model on rank 1")
        super().__init__(hf_config, layers, *args, **kwargs)


class FailsInStepOnRank1(Qwen3ForCausalLM):
    def __init__(self, hf_config, layers, *args, **kwargs):
        super().__init__(hf_config, layers, *args, **kwargs)
        self.rank = layers.group.rank

    def forward(self, input_ids, positions):
        if self.rank == 1 and bool((input_ids == FAIL_TOKEN).any()):
            raise InjectedFault("injected fault in a step on rank 1")
        return super().forward(input_ids, positions)


class SlowOrFailingOnRank1(Qwen3ForCausalLM):
    """Rank 1 sleeps in a step whose input holds SLOW_TOKEN, and fails in the step that reaches FAIL_POSITION:
    with overlapped steps, a decode launched while the step before it is still to be collected."""

    def __init__(self, hf_config, layers, *args, **kwargs):
        super().__init__(hf_config, layers, *args, **kwargs)
        self.rank = layers.group.rank

    def forward(self, input_ids, positions):
        if self.rank == 1 and bool((input_ids == SLOW_TOKEN).any()):
            import time

            time.sleep(SLOW_S)
        if self.rank == 1 and bool((positions == FAIL_POSITION).any()):
            raise InjectedFault(f"injected fault at position {FAIL_POSITION} on rank 1")
        return super().forward(input_ids, positions)


class CaptureFailsOnRank1(CpuPlatform):
    """The cpu platform, whose decode recordings fail on rank 1 only, after every step of the recording ran
    (the way a replay check or a graph instantiation fails on one GPU): rank 0's succeed."""

    def worker_device(self, device, group):
        self.rank = group.rank
        return super().worker_device(device, group)

    def capture_graphs(self, forward, ctx, limits, scratch_block, prefill_forward=None):
        graphs = super().capture_graphs(forward, ctx, limits, scratch_block, prefill_forward)
        if self.rank == 1:
            raise GraphCaptureError("injected capture failure on rank 1")
        return graphs


class ModelPlugin:
    """A plugin object registering `cls` as the Qwen3 architecture."""

    NANOPLUG_API_VERSION = PLUGIN_API_VERSION

    def __init__(self, cls):
        self.cls = cls

    @hookimpl
    def nanoplug_register_model(self, register) -> None:
        register.add("Qwen3ForCausalLM", self.cls, replace=True)


def generate_twice(llm):
    """Greedy outputs of PROMPTS, then again (the second round hits the prefix cache)."""
    from nanoplug import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, output_logits=True, ignore_eos=True)
    return [llm.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]


def torchrun_rank(checkpoint: str, out_dir: str) -> None:
    """What each torchrun process runs: the same engine and requests; saves what generate returned."""
    import os

    import torch

    from nanoplug import LLM

    from nanoplug.errors import NanoplugError

    runs = {}
    for overlap in (False, True):  # steps one after another, then overlapped
        llm = LLM(checkpoint, parallel="auto", tensor_parallel_size=2, overlap_steps=overlap, **ENGINE_OPTIONS)
        rounds = generate_twice(llm)
        try:  # a rank that asks for something else must fail on every rank, not deadlock
            llm.generate([f"rank {os.environ['RANK']} asks this"], use_tqdm=False)
            mismatch = None
        except NanoplugError as exc:
            mismatch = str(exc)
        llm.close()
        runs[overlap] = {"parallel": llm.choices["parallel"].name, "overlap": llm.engine.overlap, "mismatch": mismatch,
                         "rounds": [[(o.token_ids, o.logits, o.num_cached_tokens) for o in outs] for outs in rounds]}
    torch.save(runs, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


def hold_engine(checkpoint: str) -> None:
    """Start a tp=2 engine, print its worker pids, then keep generating until killed or interrupted.

    Python installs its Ctrl-C handler only where SIGINT is not ignored, and a child inherits an ignored
    SIGINT: a test run in the background (`pytest &` from a script) would never see KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    from nanoplug import LLM, SamplingParams

    llm = LLM(checkpoint, parallel="tensor", tensor_parallel_size=2, **ENGINE_OPTIONS)
    print("PIDS", *llm.engine.worker.worker_pids, flush=True)
    try:
        while True:
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        raise


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold_engine(sys.argv[2])
    else:
        torchrun_rank(sys.argv[1], sys.argv[2])
