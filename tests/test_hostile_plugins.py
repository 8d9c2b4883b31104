"""Misbehaving third-party plugins (issue 13, item 3): a malformed declaration is reported against its
own plugin when it registers and never takes other plugins, "auto" or `nanoplug plugins` down; a
plugin takes a built-in's name only when it says so with `register.add(name, cls, replace=True)`.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _checkpoints import checkpoint
from nanoplug import LLM, EngineConfig, SamplingParams, hookimpl
from nanoplug.cli.plugins import listing
from nanoplug.errors import PluginLoadError
from nanoplug.api import PLUGIN_API_VERSION, AttentionBackend, ModelArchitecture, Target
from nanoplug.engine.registry import Registry
from nanoplug.plugins.attention.manual import ManualAttention
from nanoplug.plugins.kv_cache.torch import TorchStore
from nanoplug.plugins.models.qwen3 import Qwen3ForCausalLM


@pytest.fixture
def cpu_target():
    return Target(device=torch.device("cpu"), dtype=torch.float32)


def plugin_module(module_name: str, plugins: dict[str, object], kind: str = "attention", **add_options):
    """A plugin module whose `kind` hook registers `plugins` ({name: class}), passing `add_options` to add."""
    module = types.ModuleType(module_name)
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION

    def register_all(register):
        for name, cls in plugins.items():
            register.add(name, cls, **add_options)

    setattr(module, f"nanoplug_register_{kind}", hookimpl(register_all))
    return module


class EntryPoint:
    """Duck-types importlib.metadata.EntryPoint for a prepared module of a named distribution."""

    def __init__(self, name: str, module, dist: str = "fake-dist"):
        self.name, self.value, self.module = name, f"{name}_module", module
        self.dist = SimpleNamespace(name=dist, version="1.0")

    def load(self):
        return self.module


def registry_with(monkeypatch, *entry_points: EntryPoint) -> Registry:
    """A registry that sees `entry_points` as the installed nanoplug plugins (other groups are left alone)."""
    real = importlib.metadata.entry_points
    with monkeypatch.context() as patch:
        patch.setattr(importlib.metadata, "entry_points",
                      lambda group=None, **kw: list(entry_points) if group == "nanoplug" else real(group=group, **kw))
        return Registry(load_entry_points=True)


def backend(**attributes) -> type:
    """A working attention backend (the manual one) with `attributes` declared on top."""
    return type("Declared", (ManualAttention,), attributes)


class _RaisingMeta(type(ManualAttention)):
    @property
    def priority(cls):
        raise RuntimeError("priority lookup exploded")


class _NotAModule(ModelArchitecture):
    pass


def _plain_unavailable(self, target):
    return []


MALFORMED = {
    "priority_str": ("attention", backend(priority="high"), "priority must be an int, found 'high'"),
    "priority_bool": ("attention", backend(priority=True), "priority must be an int, found True"),
    "priority_float": ("attention", backend(priority=1.5), "priority must be an int, found 1.5"),
    "priority_none": ("attention", backend(priority=None), "priority must be an int, found None"),
    "priority_raises": ("attention", _RaisingMeta("Raising", (ManualAttention,), {}),
                        "reading its attributes raised RuntimeError: priority lookup exploded"),
    "description_int": ("attention", backend(description=3), "description must be a str, found 3"),
    "unavailable_method": ("attention", backend(unavailable=_plain_unavailable), "unavailable must be a classmethod"),
    "unavailable_list": ("attention", backend(unavailable=["needs CUDA"]), "unavailable must be a classmethod"),
    "graphs_str": ("attention", backend(supports_cuda_graphs="yes"), "supports_cuda_graphs must be True or False"),
    "wrong_base": ("attention", TorchStore, "TorchStore is not a subclass of nanoplug.api.AttentionBackend"),
    "no_base": ("attention", type("Loose", (), {"unavailable": classmethod(lambda cls, t: [])}),
                "Loose is not a subclass of nanoplug.api.AttentionBackend"),
    "abstract": ("attention", type("NoForward", (AttentionBackend,), {}), "it does not implement forward"),
    "instance": ("attention", ManualAttention.__new__(ManualAttention), "not a class"),
    "model_not_module": ("model", _NotAModule, "_NotAModule is not a torch.nn.Module"),
    "packed_not_pairs": ("model", type("Flat", (Qwen3ForCausalLM,), {"packed_modules_mapping": {"q_proj": "qkv_proj"}}),
                         "packed_modules_mapping must map checkpoint module names to (fused module, shard id)"),
    "overlap_int": ("parallel", type("Overlap", (type(Registry(load_entry_points=False).get("parallel", "single")),),
                                     {"supports_overlap": 1}), "supports_overlap must be True or False, found 1"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_plugin_is_listed_broken_with_its_reason_and_the_others_keep_working(case, monkeypatch,
                                                                                       cpu_target):
    kind, cls, reason = MALFORMED[case]
    reg = registry_with(monkeypatch, EntryPoint("bad", plugin_module("bad_mod", {"bad_one": cls}, kind)),
                        EntryPoint("good", plugin_module("good_mod", {"good_one": backend(priority=-5)})))
    (broken,) = reg.broken
    assert broken.name == "bad" and broken.source == "fake-dist 1.0"
    assert f"{kind} plugin 'bad_one' is malformed" in broken.error and reason in broken.error
    assert "bad_one" not in reg.entries[kind] and "good_one" in reg.entries["attention"]
    assert reg.resolve("attention", "auto", cpu_target).name != "bad_one"  # auto still resolves
    data = listing(reg, cpu_target)  # what `nanoplug plugins` prints
    json.dumps(data)
    assert any(b["name"] == "bad" and reason in b["error"] for b in data["broken"])
    with pytest.raises(PluginLoadError, match="is malformed"):
        Registry(load_entry_points=False).add_plugin_module(plugin_module("bad_mod2", {"bad_one": cls}, kind), "test")


@pytest.mark.parametrize("name, options, reason", [
    ("a,b", {}, "name 'a,b' is invalid"),
    ("two words", {}, "name 'two words' is invalid"),
    ("", {}, "name '' is invalid"),
    ("fine", {"replace": "yes"}, "replace must be True or False, found 'yes'"),
])
def test_a_bad_name_or_replace_flag_is_reported(name, options, reason):
    with pytest.raises(PluginLoadError, match=reason):
        Registry(load_entry_points=False).add_plugin_module(plugin_module("named", {name: backend()}, **options), "t")


def test_a_plugin_registered_twice_by_one_module_is_reported():
    module = types.ModuleType("twice")
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION

    @hookimpl
    def nanoplug_register_attention(register):
        register.add("same", backend())
        register.add("same", backend(priority=3))

    module.nanoplug_register_attention = nanoplug_register_attention
    with pytest.raises(PluginLoadError, match="'same' is registered twice by one module"):
        Registry(load_entry_points=False).add_plugin_module(module, "t")


def test_a_module_with_one_malformed_plugin_adds_none_of_them(monkeypatch):
    """All or nothing per module, as when its hook raises: half a plugin package is not loaded."""
    module = plugin_module("half_bad", {"fine": backend(), "bad": backend(priority="high")})
    reg = registry_with(monkeypatch, EntryPoint("half", module))
    assert "fine" not in reg.entries["attention"] and "bad" not in reg.entries["attention"]
    assert "attention plugin 'bad' is malformed" in reg.broken[0].error


def test_a_class_changed_after_registering_sorts_last_instead_of_failing_auto(cpu_target):
    reg = Registry(load_entry_points=False)
    cls = backend(priority=10_000)
    reg.add_plugin_module(plugin_module("mutant", {"mutant": cls}), "t")
    cls.priority = "high"
    assert reg.by_priority("attention")[-1] == "mutant"
    assert reg.resolve("attention", "auto", cpu_target).name != "mutant"


def test_an_engine_on_auto_is_unaffected_by_a_broken_plugin(monkeypatch):
    reg = registry_with(monkeypatch, EntryPoint("bad", plugin_module("bad_engine", {"fast": backend(priority="high")})))
    assert reg.broken
    with LLM(checkpoint("qwen3"), registry=reg, attention="auto", kv_cache="torch", kv_block_size=16,
             max_model_len=64, num_kv_blocks=8) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2 and llm.choices["attention"].name != "fast"


# ------------------------------------------------------------------------- replacing built-ins
def test_a_builtin_name_is_refused_without_replace(monkeypatch, cpu_target):
    mine = backend(priority=1000, description="my manual")
    reg = registry_with(monkeypatch, EntryPoint("mine", plugin_module("mine_refused", {"manual": mine})))
    (broken,) = reg.broken
    assert "attention plugin 'manual' is already provided by built-in" in broken.error
    assert "register.add(name, cls, replace=True)" in broken.error
    assert reg.get("attention", "manual") is ManualAttention
    assert reg.entries["attention"]["manual"].source == "built-in"


def test_a_builtin_is_replaced_when_the_plugin_says_so(monkeypatch, cpu_target, caplog):
    mine = backend(priority=1000, description="my manual")
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        reg = registry_with(monkeypatch, EntryPoint("mine", plugin_module("mine_replace", {"manual": mine},
                                                                          replace=True)))
    assert reg.broken == [] and reg.get("attention", "manual") is mine
    assert "attention plugin 'manual' from fake-dist 1.0 replaces the one from built-in (replace=True)" in caplog.text
    assert reg.resolve("attention", "auto", cpu_target).name == "manual"  # in "auto" with its own priority


def test_two_plugins_of_one_name_the_second_is_refused_unless_it_replaces(monkeypatch):
    first, second = backend(priority=1), backend(priority=2)
    reg = registry_with(monkeypatch, EntryPoint("a", plugin_module("dup_a", {"fast": first}), dist="dist-a"),
                        EntryPoint("b", plugin_module("dup_b", {"fast": second}), dist="dist-b"))
    assert reg.get("attention", "fast") is first
    (broken,) = reg.broken
    assert broken.name == "b" and "'fast' is already provided by dist-a 1.0" in broken.error
    reg = registry_with(monkeypatch, EntryPoint("a", plugin_module("dup_a2", {"fast": first}), dist="dist-a"),
                        EntryPoint("b", plugin_module("dup_b2", {"fast": second}, replace=True), dist="dist-b"))
    assert reg.get("attention", "fast") is second and reg.broken == []


def test_one_source_registering_again_updates_its_own_plugin():
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(plugin_module("again", {"again": backend(priority=1)}), "t")
    newer = backend(priority=2)
    reg.add_plugin_module(plugin_module("again2", {"again": newer}), "t")
    assert reg.get("attention", "again") is newer


# -------------------------------------------------------------------------------- the CLI
def test_nanoplug_plugins_json_prints_everything_with_a_malformed_plugin_installed(tmp_path):
    """The issue's case: one installed plugin declares priority = "high"."""
    (tmp_path / "high_priority_plugin.py").write_text(
        "import nanoplug\n"
        "from nanoplug.plugins.attention.manual import ManualAttention\n"
        "NANOPLUG_API_VERSION = nanoplug.PLUGIN_API_VERSION\n"
        "class High(ManualAttention):\n"
        "    priority = 'high'\n"
        "@nanoplug.hookimpl\n"
        "def nanoplug_register_attention(register):\n"
        "    register.add('high', High)\n"
    )
    info = tmp_path / "high_priority_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: high-priority-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[nanoplug]\nhigh = high_priority_plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    env.pop("NANOPLUG_DISABLE_ENTRY_POINTS", None)
    run = [sys.executable, "-m", "nanoplug", "plugins", "--device", "cpu"]
    result = subprocess.run([*run, "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (broken,) = [b for b in data["broken"] if b["name"] == "high"]
    assert broken["source"] == "high-priority-plugin 0.1"
    assert "priority must be an int, found 'high'" in broken["error"]
    assert data["kinds"]["attention"]["auto"] not in (None, "high")
    assert {p["name"] for p in data["kinds"]["attention"]["plugins"]} >= {"manual", "sdpa"}
    text = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert text.returncode == 0 and "broken plugins (failed to load)" in text.stdout
    assert "priority must be an int" in text.stdout
