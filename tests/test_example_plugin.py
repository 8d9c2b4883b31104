"""The example third-party plugin: `pip install` is the whole integration.

The package in examples/nanoplug-example-plugin is pip-installed (from a copy, so the source tree
stays clean) into a folder of this session put on the path (so a killed run cannot leave it installed in
the environment, where it would change what other tests see), found through a fresh Registry's entry
points, and its `chunked` attention must generate what the `manual` oracle generates.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import _processes
from nanoplug import LLM, SamplingParams
from nanoplug.api import Target
from nanoplug.engine.registry import Registry

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "nanoplug-example-plugin"
DIST = "nanoplug-example-plugin"


def pip(*args: str) -> None:
    result = _processes.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


def installed() -> bool:
    try:
        importlib.metadata.distribution(DIST)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="session")
def example_plugin(tmp_path_factory):
    """Install the example package (non-editable, so this very process can import it) into a folder on the path;
    take that folder off the path after."""
    assert not installed(), f"{DIST} is installed in the environment; pip uninstall {DIST}"
    source = shutil.copytree(EXAMPLE, tmp_path_factory.mktemp("example_src") / "pkg",
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path_factory.mktemp("example_site")
    pip("install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", "--target", str(site), str(source))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield importlib.metadata.distribution(DIST), site
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()
        for name in [m for m in sys.modules if m.startswith("nanoplug_example_plugin")]:
            del sys.modules[name]


def test_entry_point_discovery(example_plugin):
    reg = Registry(load_entry_points=True)
    assert reg.broken == []
    entry = reg.entries["attention"]["chunked"]
    assert entry.source == f"{DIST} {example_plugin[0].version}" == f"{DIST} 0.1.0"
    cls = reg.get("attention", "chunked")
    assert cls.__module__ == "nanoplug_example_plugin.chunked"
    assert EXAMPLE not in Path(sys.modules[cls.__module__].__file__).parents  # the installed copy, not the source
    from nanoplug.api import AttentionBackend

    assert issubclass(cls, AttentionBackend) and cls.description


def test_availability_and_auto(example_plugin):
    reg = Registry(load_entry_points=True)
    cpu = torch.device("cpu")
    assert reg.reasons("attention", "chunked", Target(device=cpu, dtype=torch.float32)) == []
    reasons = reg.reasons("attention", "chunked", Target(device=cpu, dtype=torch.float64))
    assert reasons == ["dtype torch.float64 unsupported; use float32, float16 or bfloat16"]
    assert reg.resolve("attention", "auto", Target(device=cpu, dtype=torch.float32)).name != "chunked"


def test_cli_lists_it_with_its_distribution(example_plugin):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(example_plugin[1]), os.environ.get("PYTHONPATH")]))}
    result = _processes.run([sys.executable, "-m", "nanoplug", "plugins", "--json"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    plugins = json.loads(result.stdout)["kinds"]["attention"]["plugins"]
    chunked = next(p for p in plugins if p["name"] == "chunked")
    assert chunked["source"] == f"{DIST} 0.1.0" and chunked["available"] and chunked["priority"] == -10


def test_generates_what_manual_generates(example_plugin, qwen3_dir):
    """Prefill in chunks (max_num_batched_tokens 16), decode, and a prefix-cache hit on the second round."""
    reg = Registry(load_entry_points=True)
    prompts = ["The quick brown fox jumps over the lazy dog, and then it runs far away into the forest",
               "Hello", "The quick brown fox jumps over the lazy dog, and then it sleeps"]
    params = SamplingParams(temperature=0, max_tokens=5, output_logits=True)
    results = {}
    for attention in ("manual", "chunked"):
        llm = LLM(str(qwen3_dir), registry=reg, attention=attention, kv_cache="torch", kv_block_size=16,
                  max_model_len=128, num_kv_blocks=32, max_num_batched_tokens=16)
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts[:1], params, use_tqdm=False)
        assert second[0].num_cached_tokens > 0
        assert llm.choices["attention"].name == attention
        results[attention] = first + second
        llm.close()
    for ours, oracle in zip(results["chunked"], results["manual"]):
        assert ours.token_ids == oracle.token_ids
        for a, b in zip(ours.logits, oracle.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_its_int8_weight_format_serves_an_engine_close_to_dense(example_plugin, qwen3_dir):
    """A weight format written only against nanoplug.api, found through its entry point: quantization="int8_rows"
    keeps every linear weight in int8, and the first token's logits stay within int8 rounding of the dense engine's."""
    reg = Registry(load_entry_points=True)
    assert reg.entries["weight_format"]["int8_rows"].source == f"{DIST} 0.1.0"
    options = dict(registry=reg, attention="sdpa", kv_cache="torch", kv_block_size=16, max_model_len=128,
                   num_kv_blocks=32, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_logits=True)
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello"]
    dense, int8 = LLM(str(qwen3_dir), **options), LLM(str(qwen3_dir), quantization="int8_rows", **options)
    try:
        assert dense.choices["weight_format"].name == "dense"  # "auto" never picks a format that quantizes
        assert int8.choices["weight_format"].name == "int8_rows"
        assert any(line.startswith("weight_format: asked 'int8_rows'") for line in int8.describe_plugins())
        linear = [m for m in int8.engine.worker.model.modules() if getattr(m, "role", None) == "linear"]
        assert linear and all(m.weight.dtype == torch.int8 for m in linear)
        for want, got in zip(dense.generate(prompts, params, use_tqdm=False), int8.generate(prompts, params, use_tqdm=False)):
            a, b = want.logits[0], got.logits[0]
            assert not torch.equal(a, b)  # the format computed, not the dense path
            assert ((b - a).norm() / a.norm()).item() < 0.05
    finally:
        dense.close()
        int8.close()
