"""The per-request LoRA kernels (nanoplug/kernels/lora/triton_kernels.py) on CPU through the Triton interpreter
(TRITON_INTERPRET=1 must be set before the kernels are defined, so the module is reloaded after setting it,
whatever another test imported first):

- a layer's update through the kernels, and through the plain masked path, equals a float64 per-token
  reference (each token: its own adapter's x @ A.T @ B.T, slice by slice) within float32 rounding, for
  mixed adapters and tokens without one, ranks padded, packed slices (some no adapter targets), an input
  split over several shrink programs, and 1, 7 and 64 tokens;
- the kernels read only the adapters a step's tokens use: the others' factors poisoned with NaN change
  nothing, bit for bit (the masked path multiplies them by zero, which NaN survives);
- what a CUDA graph replay relies on: rows past the step's tokens and a step without adapter tokens after
  one with them leave the output as it was, since every launch runs whatever the table lists;
- engines on the kernel path give each request what an engine with its adapter merged gives (the float32
  tests of test_lora.py, on one rank and on two tensor-parallel ranks).
"""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import nanoplug.kernels.lora.triton_kernels as kernels  # noqa: E402
from _lora_layers import adapted_layer, mixed_ids, poison_unused, reference  # noqa: E402
from test_lora import check_per_request_equals_merged, check_tensor_parallel_per_request  # noqa: E402

kernels = importlib.reload(kernels)  # the same module object multi_lora.py calls, now defined for the interpreter
IN = 300  # not a multiple of BLOCK_IN, and more than CHUNK_IN: the shrink sums two partial products
RANKS = (4, 12, 8, 1, 5)  # padded to R = 12 (not a power of two)
K, R = len(RANKS), max(RANKS)
LAYOUTS = {  # name -> output rows of each packed slice, and the slices the adapters target
    "qkv": ([48, 16, 16], [0, 1, 2]),  # slice 0 spans two expand blocks, the second one partial
    "gate_up, only up adapted": ([40, 40], [1]),
    "unpacked": ([70], [0]),
}


def layer(layout: str, use_kernels: bool = True):
    sizes, adapted = LAYOUTS[layout]
    return adapted_layer(sizes, adapted, RANKS, IN, use_kernels, max_tokens=64)


# ------------------------------------------------------------------------------------------ kernels
def test_the_kernels_serve_here():
    assert kernels.INTERPRETED and not kernels.unavailable(torch.device("cpu"), torch.float32)
    assert kernels.unavailable(torch.device("cpu"), torch.bfloat16)  # the interpreter computes in float32


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "masked"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_update_equals_per_token_reference(use_kernels, layout, num_tokens):
    lora, rows = layer(layout, use_kernels)
    x = torch.randn(num_tokens, IN, generator=torch.Generator().manual_seed(num_tokens))
    ids = mixed_ids(num_tokens, K, seed=num_tokens)
    lora.slots.set_step(ids)
    base = lora.base(x)
    got = lora(x)
    want = base.double() + reference(x, lora, ids, rows, K, R)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    none = ids == 0
    assert torch.equal(got[none], base[none])  # tokens without an adapter: the base output untouched


def test_tiles_group_each_adapted_token_once():
    rng = np.random.default_rng(3)
    for num_tokens, num_adapters in ((64, 32), (300, 3), (5, 1)):
        ids = rng.integers(0, num_adapters + 1, size=num_tokens)
        plan = kernels.plan_tiles(ids, num_adapters, max_tokens=512)
        table = kernels.max_tiles(512, num_adapters)
        tiles, order = plan[:3 * table].reshape(-1, 3), plan[3 * table:]
        used = tiles[tiles[:, 0] >= 0]
        assert (tiles[len(used):, 0] == -1).all() and len(used) <= kernels.max_tiles(num_tokens, num_adapters)
        seen = []
        for k, start, end in used:
            assert 0 < end - start <= kernels.BLOCK_M
            assert (ids[order[start:end]] == k + 1).all()
            seen += order[start:end].tolist()
        assert sorted(seen) == np.flatnonzero(ids).tolist()


def test_kernels_read_only_the_adapters_the_tokens_use():
    lora, _ = layer("qkv")
    x = torch.randn(40, IN, generator=torch.Generator().manual_seed(7))
    ids = torch.from_numpy(np.random.default_rng(7).choice([0, 2, 5], size=40))
    lora.slots.set_step(ids)
    clean = lora(x)
    poison_unused(lora, ids, K, R)  # adapter ids 1, 3 and 4
    poisoned = lora(x)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)


def test_replays_see_only_the_steps_tokens():
    """A graph of 8 rows replays a step of 5 tokens: the 3 padded rows keep the base output; then a step
    without adapter tokens leaves every row as it was, although the launch still runs."""
    lora, rows = layer("qkv")
    slots = lora.slots
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(8))
    base = lora.base(x)

    def replay() -> torch.Tensor:
        return kernels.add_lora(x, base.clone(), lora.lora_a, lora.lora_b, slots.tiles, slots.order, lora.columns,
                                lora.num_slices, K, R)

    ids = torch.tensor([2, 0, 5, 2, 1])
    slots.set_step(ids)
    got = replay()
    want = base[:5].double() + reference(x[:5], lora, ids, rows, K, R)
    assert (got[:5].double() - want).abs().max() < 1e-5 * want.abs().max()
    assert torch.equal(got[5:], base[5:])
    slots.set_step(torch.zeros(3, dtype=torch.int64))
    assert not slots.needed() and torch.equal(replay(), base)


# ------------------------------------------------------------------------------------------- engine
def test_engine_on_the_kernels_equals_engines_with_the_adapter_merged():
    llm = check_per_request_equals_merged()
    assert llm.engine.worker.request_adapters.kernels


def test_tensor_parallel_on_the_kernels():
    check_tensor_parallel_per_request()
