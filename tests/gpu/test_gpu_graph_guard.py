"""No decode step of a graph-enabled CUDA engine runs eager: for each attention backend that claims
`supports_cuda_graphs` (flash, triton, xformers, sdpa), decode batches of 1, 7, 64 and 256 sequences (256:
the largest of cuda/graphs.py's sizes that max_num_seqs allows) over mixed context lengths all replay graphs
(the worker's `StepStats`, and the steps it launched), and their logits equal the eager engine's
(`cuda.enforce_eager`) to the bf16 tolerance, position by position up to where the greedy tokens part. The graph
that serves each batch was captured around the backend's own decode op, in every layer (watched while
graphs are captured: xformers' forward entry point, FlashAttention's decode call, our Triton kernel's
launcher, which `flash` decodes by on Hopper), and the graph engine's decode steps call none of them from
Python (they replay; flash and xformers, whose ops serve decode steps only). sdpa's decode steps run PyTorch's `varlen_attn`, never its
padded fallback (the paths its backend counts).

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_graph_guard.py`, in both processes of
tests/gpu/_two_processes.py; a backend that cannot load in one must say why (its error names the fix)."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from _checkpoints import relative_error
from _graph_guard import StepLog
from _two_processes import reason_here
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.plugins.platforms.cuda.graphs import GRAPH_BATCH_SIZES

pytestmark = pytest.mark.gpu
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128)
BATCHES = (1, 7, 64, 256)
MAX_TOKENS = 6
# a fixed cache (no memory profiling against the other engine of this test): 256 contexts of up to 3 pages
ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=1024, kv_block_size=256, num_kv_blocks=1024)
XFORMERS_DECODE = ("triton_splitKF", "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask")  # op and mask decode runs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    return str(write_random_checkpoint(tmp_path_factory.mktemp("gpu-graph-guard") / "q3", **GPU_SHAPE))


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """Contexts of 1 to 700 tokens (within one page, across two or three), the first the longest."""
    rng = random.Random(batch)
    lengths = [700] + [rng.randint(1, 700) for _ in range(batch - 1)]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


class XformersCalls:
    """Every call into xformers' forward (`xformers.ops.fmha._memory_efficient_attention_forward`, which
    `memory_efficient_attention_forward` goes through): (the op named, or None when xformers dispatches;
    the mask's type; query rows; whether a CUDA graph was being captured)."""

    def __init__(self):
        import xformers.ops.fmha as fmha

        self.calls: list[tuple[str | None, str, int, bool]] = []
        self._fmha, self._forward = fmha, fmha._memory_efficient_attention_forward
        fmha._memory_efficient_attention_forward = self._called

    def _called(self, inp, op):
        self.calls.append((op.NAME if op is not None else None, type(inp.attn_bias).__name__, inp.query.shape[1],
                           torch.cuda.is_current_stream_capturing()))
        return self._forward(inp, op)

    def close(self) -> None:
        self._fmha._memory_efficient_attention_forward = self._forward

    def decode(self) -> list[tuple[int, bool]]:
        """(rows, captured) of the calls that ran xformers' decode op."""
        return [(rows, capturing) for name, mask, rows, capturing in self.calls if (name, mask) == XFORMERS_DECODE]


class FlashCalls:
    """Every decode call into FlashAttention (flash.py's `load_kernels` answers with the same build, its entry
    points watched): FA4's `flash_attn_varlen_func` given one-token query batches [B, 1, H, D], or FA2's
    `flash_attn_with_kvcache`; as (query rows, whether a CUDA graph was being captured)."""

    def __init__(self):
        from nanoplug.plugins.attention import flash

        self.calls: list[tuple[int, bool]] = []
        self._flash, self._load = flash, flash.load_kernels
        kernels, errors = flash.load_kernels()
        watched = dataclasses.replace(kernels, varlen=self._watch(kernels.varlen, lambda q: q.dim() == 4),
                                      with_kvcache=kernels.with_kvcache and self._watch(kernels.with_kvcache,
                                                                                        lambda q: True))
        flash.load_kernels = lambda: (watched, errors)

    def _watch(self, fn, is_decode):
        def call(q, *args, **kwargs):
            if is_decode(q):
                self.calls.append((q.shape[0], torch.cuda.is_current_stream_capturing()))
            return fn(q, *args, **kwargs)
        return call

    def close(self) -> None:
        self._flash.load_kernels = self._load

    def decode(self) -> list[tuple[int, bool]]:
        return list(self.calls)


class TritonCalls:
    """Every call of our Triton paged-decode kernel's launcher (triton_decode.paged_decode): (rows, capturing)."""

    def __init__(self):
        from nanoplug.kernels.attention import triton_decode

        self.calls: list[tuple[int, bool]] = []
        self._module, self._launch = triton_decode, triton_decode.paged_decode
        triton_decode.paged_decode = self._called

    def _called(self, q, *args, **kwargs):
        self.calls.append((q.shape[0], torch.cuda.is_current_stream_capturing()))
        return self._launch(q, *args, **kwargs)

    def close(self) -> None:
        self._module.paged_decode = self._launch

    def decode(self) -> list[tuple[int, bool]]:
        return list(self.calls)


def flash_calls():
    """The decode op `flash` runs here: our Triton kernel on Hopper with FA4 (flash.splits_decode), else FA's."""
    from nanoplug.plugins.attention import flash

    kernels, _ = flash.load_kernels()
    return TritonCalls() if flash.splits_decode(kernels, torch.device("cuda")) else FlashCalls()


WATCHERS = {"xformers": XformersCalls, "flash": flash_calls, "triton": TritonCalls}  # sdpa counts its own paths


@pytest.fixture(scope="module", params=["flash", "triton", "xformers", "sdpa"])
def runs(request, model):
    """{eager: {batch: (outputs, stats of its steps, decode batch sizes, xformers decode calls)}, "captured":
    xformers decode calls while graphs were captured, by query rows} for one attention backend; None in
    place of that where it cannot load in this process (tests/gpu/_two_processes.py) and its error says why."""
    from nanoplug.errors import NanoplugError

    attention = request.param
    watch = WATCHERS[attention]() if attention in WATCHERS and reason_here(attention) is None else None
    try:
        return attention, run_engines(model, attention, watch)
    except NanoplugError as exc:
        why = reason_here(attention)
        if why is None or why not in str(exc):
            raise
        return attention, None
    finally:
        if watch is not None:
            watch.close()


def run_engines(model, attention: str, watch) -> dict:
    from nanoplug import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_logits=True)
    out = {}
    for eager in (True, False):
        cuda = {"enforce_eager": True} if eager else {"require_graphs": True}  # a failed capture stops here
        if watch is not None:
            watch.calls.clear()
        llm = LLM(model, attention=attention, cuda=cuda, **ENGINE)
        try:
            worker = llm.engine.worker
            assert (worker.graphs is None) == eager
            assert eager or worker.graph_limit == 256
            if watch is not None and not eager:
                out["captured"] = Counter(rows for rows, capturing in watch.decode() if capturing)
            steps = StepLog(worker)
            out[eager] = {}
            for batch in BATCHES:
                before = worker.report().stats
                paths = dict(getattr(worker.ctx.decode, "paths", {}))  # sdpa's steps by (kind, path)
                steps.steps.clear()
                if watch is not None:
                    watch.calls.clear()
                outputs = llm.generate(prompts(batch, llm.engine.facts.vocab_size), params, use_tqdm=False)
                after = worker.report().stats
                grew = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)}
                grew["paths"] = {k: n - paths.get(k, 0) for k, n in getattr(worker.ctx.decode, "paths", {}).items()
                                 if n > paths.get(k, 0)}
                calls = watch.decode() if watch is not None else None
                out[eager][batch] = (outputs, grew, steps.decode_batches(), calls)
        finally:
            llm.close()
    return out


@pytest.mark.parametrize("batch", BATCHES)
def test_every_decode_step_replays_a_graph(runs, batch):
    attention, out = runs
    if out is None:
        return  # cannot load in this process, and its error said why (the fixture)
    _, grew, decodes, calls = out[False][batch]
    assert max(decodes) == batch, (attention, decodes)  # the whole batch decoded together
    assert grew["eager_decode_steps"] == 0 and grew["eager_decode_steps_by_design"] == 0, (attention, grew)
    assert grew["graph_replays"] == len(decodes) > 0, (attention, grew, decodes)
    if attention == "sdpa":  # each decode step through varlen_attn (packed pages on torch 2.11), none padded
        decode_paths = {path: n for (kind, path), n in grew["paths"].items() if kind == "decode"}
        assert sum(decode_paths.values()) == len(decodes) and all(p.startswith("varlen") for p in decode_paths), grew
    _, eager_grew, eager_decodes, eager_calls = out[True][batch]
    assert eager_grew["graph_replays"] == 0 and eager_grew["eager_decode_steps_by_design"] > 0  # the reference
    if attention in WATCHERS:  # every graph was captured around the backend's own decode op, in every layer
        layers = GPU_SHAPE["num_hidden_layers"]
        assert out["captured"] == {size: layers for size in GRAPH_BATCH_SIZES if size <= 256}, out["captured"]
        if attention != "triton":  # (triton's kernel also serves prefill steps of one-token queries, eager)
            assert calls == [], calls  # and replays call nothing from Python
            assert eager_calls == [(n, False) for n in eager_decodes for _ in range(layers)], eager_calls


@pytest.mark.parametrize("batch", BATCHES)
def test_replayed_logits_equal_eager(runs, batch):
    # a graph's kernels (and the fused small-op kernels, which eager runs without) sum in another order; this
    # random model's near ties may then flip a greedy token, after which the inputs differ. So the logits are
    # compared position by position up to where the tokens part, to the bf16 tolerance.
    attention, out = runs
    if out is None:
        return  # cannot load in this process, and its error said why (the fixture)
    compared = 0
    for a, b in zip(out[True][batch][0], out[False][batch][0], strict=True):
        assert len(a.logits) == len(b.logits) == MAX_TOKENS
        for i, (la, lb) in enumerate(zip(a.logits, b.logits)):
            if a.token_ids[:i] != b.token_ids[:i]:
                break
            assert relative_error(lb.float(), la.float()) < 2.5e-2, (attention, batch, i, a.token_ids, b.token_ids)
            compared += 1
    assert compared >= batch * MAX_TOKENS // 2, (attention, batch, compared)
