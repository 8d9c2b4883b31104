"""Per-request LoRA on CUDA through the Triton kernels (nanoplug/kernels/lora/triton_kernels.py), in bf16:

- a layer's update equals the float64 per-token reference (each token: its own adapter) and the plain
  masked path to bf16 rounding, for 1 to 300 tokens and 4 or 32 adapters; the factors of adapters no
  token uses, poisoned with NaN, change nothing;
- the launches captured once in a CUDA graph replay each step's mix: other adapters, fewer tokens than
  the graph (padded rows keep the base output) and a step without adapter tokens, bit for bit as eager;
- an engine serving 4 adapters per request compiles the kernels at start-up (none after), decodes under
  CUDA graphs (no decode step eager) and gives the eager engine's logits to the bf16 tolerance.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_lora_kernels.py`."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from _checkpoints import relative_error
from _graph_guard import Compilations
from _lora_layers import adapted_layer, mixed_ids, poison_unused, reference, write_lora
from nanoplug.bench.checkpoints import write_random_checkpoint

pytestmark = pytest.mark.gpu
IN, SIZES = 1024, [256, 128, 128]  # a qkv-like layer; the input splits over four shrink programs
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128)
ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=1024, kv_block_size=256, num_kv_blocks=1024)
MAX_TOKENS = 6


def ranks_of(num_adapters: int) -> tuple[int, ...]:
    return (16, 8, 16, 4) if num_adapters == 4 else (16,) * num_adapters


def zero_base_layer(num_adapters: int, use_kernels: bool):
    """A bf16 layer whose base output is zero, so the comparison sees the update's own rounding."""
    layer, rows = adapted_layer(SIZES, [0, 1, 2], ranks_of(num_adapters), IN, use_kernels, max_tokens=512,
                                dtype=torch.bfloat16, device="cuda")
    layer.base.weight.zero_()
    return layer, rows


@pytest.mark.parametrize("num_adapters", [4, 32])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_kernels_equal_reference_in_bf16(num_adapters, num_tokens):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    kernel_layer, rows = zero_base_layer(num_adapters, True)
    masked_layer, _ = zero_base_layer(num_adapters, False)
    r = max(ranks_of(num_adapters))
    x = torch.randn(num_tokens, IN, generator=torch.Generator().manual_seed(num_tokens)).to("cuda", torch.bfloat16)
    ids = mixed_ids(num_tokens, num_adapters, seed=num_tokens)
    kernel_layer.slots.set_step(ids)
    masked_layer.slots.set_step(ids)
    got, masked = kernel_layer(x), masked_layer(x)
    want = reference(x, kernel_layer, ids, rows, num_adapters, r)
    assert relative_error(got.cpu(), want) < 1e-2
    assert relative_error(masked.cpu(), want) < 1e-2
    assert not got[ids.cuda() == 0].any()  # tokens without an adapter: the (zero) base output untouched
    poison_unused(kernel_layer, ids, num_adapters, r)
    again = kernel_layer(x)
    assert torch.isfinite(again).all() and torch.equal(again, got)


def test_captured_launches_replay_each_steps_adapters():
    layer, _ = zero_base_layer(4, True)  # (a GEMM of other rows may pick another algorithm: not bit for bit)
    static = torch.randn(64, IN, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    layer.slots.set_step(mixed_ids(64, 4, seed=0))
    layer(static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    for n, seed in ((64, 1), (40, 2), (10, None)):
        ids = mixed_ids(n, 4, seed=seed) if seed is not None else torch.zeros(n, dtype=torch.int64)
        layer.slots.set_step(ids)
        graph.replay()
        eager = layer(static[:n])
        assert torch.equal(out[:n], eager), n
        assert not out[n:].any(), n  # padded rows: the (zero) base output untouched


def lora_kernels(compiled: list[str]) -> list[str]:
    """The LoRA kernels' specializations among the Triton compiles `Compilations` saw."""
    return [c for c in compiled if c.startswith(("_shrink_kernel[", "_expand_kernel["))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    root = tmp_path_factory.mktemp("gpu-lora-kernels")
    path = write_random_checkpoint(root / "q3", **GPU_SHAPE)
    config = json.loads((Path(path) / "config.json").read_text())
    loras = [write_lora(root / f"lora{k}", config, seed=k) for k in range(4)]
    return str(path), loras


def test_engine_decodes_per_request_adapters_under_graphs(model):
    from nanoplug import LLM, SamplingParams

    path, loras = model
    adapters = [{"path": p, "name": f"a{k}", "merge": False} for k, p in enumerate(loras)]
    choices = [None, "a0", "a1", "a2", "a3"]
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(5 + 11 * i)] for i in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_logits=True,
                             adapter=choices[i % len(choices)]) for i in range(len(prompts))]
    out = {}
    for eager in (True, False):
        cuda = {"enforce_eager": True} if eager else {"require_graphs": True}  # a failed capture stops here
        with Compilations() as compiled:
            llm = LLM(path, adapters=adapters, cuda=cuda, **ENGINE)
            at_startup = lora_kernels(compiled.triton)
            try:
                worker = llm.engine.worker
                assert (worker.graphs is None) == eager
                assert worker.request_adapters.kernels and worker.request_adapters.graph_safe
                before = worker.report().stats
                out[eager] = llm.generate(prompts, params, use_tqdm=False)
                after = worker.report().stats
            finally:
                llm.close()
        assert lora_kernels(compiled.triton) == at_startup  # compiled at start-up (or earlier), never after
        grew = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)}
        if not eager:
            assert grew["eager_decode_steps"] == 0 and grew["graph_replays"] > 0, grew
    compared = 0
    for a, b in zip(out[True], out[False], strict=True):
        for i, (la, lb) in enumerate(zip(a.logits, b.logits)):
            if a.token_ids[:i] != b.token_ids[:i]:
                break  # a near tie flipped a greedy token; the inputs differ from here on
            # 3e-2: the sixth token's logits carry five steps of bf16 rounding summed in two orders (graphs
            # run the fused small-op kernels, eager the plain ops) plus the adapters' two extra products
            assert relative_error(lb.float(), la.float()) < 3e-2, (i, a.token_ids, b.token_ids)
            compared += 1
    assert compared >= len(prompts) * MAX_TOKENS // 2, compared
