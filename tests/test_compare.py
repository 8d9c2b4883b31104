"""Fast paths against the plain ones on identical inputs (`nanoplug compare`'s scenario): the CPU
subset. Attention `sdpa` and `cpu` against `manual`, and the `triton` KV store (through the Triton interpreter)
against `torch`, in prefill, decode, prefix-cache hits and chunked prefill. tests/gpu/ runs every
backend on CUDA in bf16."""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined: the CPU runs Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from nanoplug.bench.checkpoints import write_random_checkpoint  # noqa: E402
from nanoplug.cli import compare  # noqa: E402

import nanoplug.plugins.kv_cache.triton as triton_store  # noqa: E402

importlib.reload(triton_store)
CASES = ("prefill", "decode", "prefix-hit", "chunked", "decode-mixed")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return str(write_random_checkpoint(tmp_path_factory.mktemp("compare") / "q3"))


@pytest.fixture(scope="session")
def manual_outcome(tiny_qwen3):
    outcome = compare.run_backend(tiny_qwen3, "manual", device="cpu", dtype="float32", block_size=16)
    assert outcome.error is None
    return outcome


@pytest.fixture(autouse=True)
def nan_fresh_cache(monkeypatch):
    """A fresh CPU cache is uninitialized memory; make it NaN so a backend reading unwritten slots fails
    here every time, not only when the allocator happens to hand back NaN bytes."""
    from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

    allocate = CpuPlatform.allocate_kv_cache

    def allocate_poisoned(self, shape, dtype, device):
        return allocate(self, shape, dtype, device).fill_(float("nan"))

    monkeypatch.setattr(CpuPlatform, "allocate_kv_cache", allocate_poisoned)


def test_scenario_really_hits_the_cache():
    """The prefix step reuses seq 0's blocks and starts after them; chunks continue their sequence."""
    state = compare.ScenarioState(16, 1000)
    batches = [state.batch(step) for step in state.steps]
    prefix = batches[3]
    assert prefix.starts == [32, 0] and prefix.block_tables[0][:2] == batches[0].block_tables[0][:2]
    assert prefix.input_ids[:5] == state.tokens[3][32:37]
    assert batches[5].starts == [16 + 3]
    assert [b.is_prefill for b in batches] == [True, False, False, True, True, True, False]


@pytest.mark.parametrize("kind,name,options", [
    ("attention", "sdpa", {}),
    ("kv_cache", "triton", {"attention": "manual"}),
    ("kv_cache", "triton", {"attention": "sdpa"}),
    ("kv_cache", "cpu", {"attention": "manual"}),
])
def test_backend_matches_reference(tiny_qwen3, manual_outcome, kind, name, options):
    outcome = compare.run_backend(tiny_qwen3, name, kind, device="cpu", dtype="float32", block_size=16, **options)
    assert outcome.error is None, outcome.error
    diffs = compare.differences(outcome, manual_outcome)
    assert set(diffs) == set(CASES)
    for case, (abs_diff, rel_diff) in diffs.items():
        assert rel_diff < 1e-5 and abs_diff < 1e-4, (case, abs_diff, rel_diff)


@pytest.fixture(scope="session")
def head64(tmp_path_factory):
    """Head size 64, 3 query heads per KV head, like SmolLM2's: a shape the `cpu` backend serves."""
    return str(write_random_checkpoint(tmp_path_factory.mktemp("compare") / "q3h64", head_dim=64,
                                       num_attention_heads=6, num_key_value_heads=2))


def test_cpu_decode_kernel_matches_reference(head64):
    """The `cpu` backend's C++ decode kernel on the NaN-filled cache: it must read only the slots the
    scenario wrote."""
    path = head64
    reference = compare.run_backend(path, "manual", device="cpu", dtype="float32", block_size=16)
    outcome = compare.run_backend(path, "cpu", device="cpu", dtype="float32", block_size=16)
    assert reference.error is None and outcome.error is None, (reference.error, outcome.error)
    diffs = compare.differences(outcome, reference)
    assert set(diffs) == set(CASES)
    for case, (abs_diff, rel_diff) in diffs.items():
        assert rel_diff < 1e-5 and abs_diff < 1e-4, (case, abs_diff, rel_diff)


def test_cli_table_names_reasons(tiny_qwen3, capsys):
    parser = __import__("nanoplug.cli", fromlist=["build_parser"]).build_parser()
    args = parser.parse_args(["compare", "--attention", "sdpa,flash,manual", "--model", tiny_qwen3,
                              "--device", "cpu", "--dtype", "float32", "--kv-block-size", "16"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "sdpa       decode" in out and "flash      cannot serve" in out and "needs CUDA" in out
    assert torch.isfinite(torch.tensor([float(line.split()[2]) for line in out.splitlines() if line.startswith("sdpa")])).all()
    assert "verdict: AGREE: sdpa, manual within the relative logits difference against 'manual' at most 1e-04, " \
           "the tolerance for float32 compute with dense weights (flash could not run)" in out


def test_the_verdict_states_the_tolerance_of_the_dtype_and_weight_format():
    reference = compare.Outcome("manual", {"decode": [torch.ones(4)]}, dtype="float32", weights="gguf")
    close = compare.Outcome("cpu", {"decode": [torch.ones(4) * (1 + 5e-4)]}, dtype="float32", weights="gguf")
    far = compare.Outcome("sdpa", {"decode": [torch.ones(4) * (1 + 5e-3)]}, dtype="float32", weights="gguf")
    agree, line = compare.verdict([close, reference], reference)
    assert agree and "at most 1e-03, the tolerance for float32 compute with gguf weights" in line
    agree, line = compare.verdict([close, far, reference], reference)
    assert not agree and line.startswith("verdict: DIFFERENT: sdpa decode 5.00e-03 over")
    dense = compare.Outcome("manual", {"decode": [torch.ones(4)]}, dtype="float32", weights="dense")
    assert not compare.verdict([compare.Outcome("cpu", close.logits, dtype="float32", weights="dense")], dense)[0]


def test_by_default_every_backend_that_serves_the_device_is_compared(head64):
    names, skipped = compare.serving_backends(head64, "cpu", "float32")
    assert {"cpu", "sdpa", "manual"} <= set(names) and {"flash", "xformers"} <= set(skipped)
    args = __import__("nanoplug.cli", fromlist=["build_parser"]).build_parser().parse_args(["compare"])
    assert args.attention is None and args.model is None  # -> serving_backends on the default model
