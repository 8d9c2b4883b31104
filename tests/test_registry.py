"""The registry: lazy built-ins, entry-point discovery, availability reasons, resolution and its errors.

Fake plugins are plain modules built here and fed through `Registry.add_plugin_module` or through
monkeypatched entry points, so every path runs without installing anything.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import types
from types import SimpleNamespace

import pytest
import torch

from nanoplug import LLM, SamplingParams, hookimpl
from nanoplug.errors import PluginLoadError, PluginUnavailableError, UnknownPluginError
from nanoplug.api import PLUGIN_API_VERSION, Target
from nanoplug.engine.registry import KIND_HOOKS, PluginEntry, Registry, default_registry
from nanoplug.plugins.attention.manual import ManualAttention


@pytest.fixture
def cpu_target():
    return Target(device=torch.device("cpu"), dtype=torch.float32)


def fake_attention_module(module_name: str, plugins: dict[str, type], api_version=PLUGIN_API_VERSION,
                          replace: bool = False):
    """A plugin module registering `plugins` ({name: class}) as attention backends."""
    module = types.ModuleType(module_name)
    module.NANOPLUG_API_VERSION = api_version

    @hookimpl
    def nanoplug_register_attention(register):
        for name, cls in plugins.items():
            register.add(name, cls, replace=True) if replace else register.add(name, cls)

    module.nanoplug_register_attention = nanoplug_register_attention
    return module


def backend(priority: int, reasons: list[str] | None = None, description: str = "fake") -> type:
    """A ManualAttention subclass with this priority that reports `reasons` (None: available)."""
    return type("FakeBackend", (ManualAttention,), {
        "priority": priority, "description": description,
        "unavailable": classmethod(lambda cls, target: list(reasons or [])),
    })


class FakeEntryPoint:
    """Duck-types importlib.metadata.EntryPoint: `load()` returns a prepared module or raises."""

    def __init__(self, name, module=None, error=None, dist=("fake-dist", "1.2")):
        self.name, self.value, self._module, self._error = name, f"{name}_module", module, error
        self.dist = SimpleNamespace(name=dist[0], version=dist[1]) if dist else None

    def load(self):
        if self._error is not None:
            raise self._error
        return self._module


@pytest.fixture
def entry_points(monkeypatch):
    """Set the entry points the registry sees: `entry_points([FakeEntryPoint(...), ...])`."""
    seen_groups = []

    def install(eps):
        def fake(group):
            seen_groups.append(group)
            return list(eps)

        monkeypatch.setattr(importlib.metadata, "entry_points", fake)
        return seen_groups

    return install


# ----------------------------------------------------------------------------------- built-ins
def test_builtins_of_every_kind_are_listed_and_not_imported_until_asked():
    reg = Registry(load_entry_points=False)
    assert set(reg.entries) == set(KIND_HOOKS) == {"attention", "kv_cache", "model", "parallel", "adapter",
                                                  "weight_format", "platform", "structured_output", "speculator"}
    assert {"manual", "sdpa", "flash", "xformers"} <= set(reg.names("attention"))
    assert {"torch", "triton"} <= set(reg.names("kv_cache"))
    assert {"Qwen3ForCausalLM", "LlamaForCausalLM"} <= set(reg.names("model"))
    assert {"single", "tensor"} <= set(reg.names("parallel"))
    assert reg.names("adapter") == ["lora"]  # adapters are LoRA; weight formats are their own kind
    assert {"dense", "gguf", "gguf_triton", "fp8"} <= set(reg.names("weight_format"))
    assert {"cpu", "cuda"} <= set(reg.names("platform"))
    assert {"xgrammar", "llguidance"} <= set(reg.names("structured_output"))
    assert {"ngram"} <= set(reg.names("speculator"))
    assert all(e.cls is None and e.source == "built-in" for k in reg.entries.values() for e in k.values())
    assert reg.get("attention", "manual") is ManualAttention
    assert reg.entries["attention"]["manual"].cls is ManualAttention
    assert reg.entries["attention"]["sdpa"].cls is None  # still lazy


def test_builtin_whose_module_is_missing_reports_the_import_error(cpu_target):
    reg = Registry(load_entry_points=False)
    reg.entries["attention"]["ghost"] = PluginEntry("attention", "ghost", "built-in",
                                                    target="nanoplug.plugins.attention.ghost_absent:Ghost")
    with pytest.raises(PluginLoadError) as err:
        reg.resolve("attention", "ghost", cpu_target)
    msg = str(err.value)
    assert "'ghost'" in msg and "ModuleNotFoundError" in msg and "ghost_absent" in msg
    assert "not part of this build yet" in msg
    (reason,) = reg.reasons("attention", "ghost", cpu_target)
    assert "ModuleNotFoundError" in reason
    assert reg.by_priority("attention")[-1] == "ghost"  # sorts last, never chosen by auto
    assert reg.resolve("attention", "auto", cpu_target).name != "ghost"


def test_builtin_target_naming_a_missing_object_reports_it(cpu_target):
    reg = Registry(load_entry_points=False)
    reg.entries["attention"]["typo"] = PluginEntry("attention", "typo", "built-in",
                                                   target="nanoplug.plugins.attention.manual:NoSuchClass")
    (reason,) = reg.reasons("attention", "typo", cpu_target)
    assert "AttributeError" in reason and "NoSuchClass" in reason


# ------------------------------------------------------------------------------------ lookups
def test_unknown_name_lists_the_valid_names(cpu_target):
    reg = Registry(load_entry_points=False)
    with pytest.raises(UnknownPluginError) as err:
        reg.resolve("attention", "flashy", cpu_target)
    msg = str(err.value)
    assert "unknown attention plugin 'flashy'" in msg
    assert "valid names:" in msg and "manual" in msg and "sdpa" in msg and "'auto'" in msg


def test_unknown_kind_lists_the_kinds():
    with pytest.raises(UnknownPluginError, match="unknown plugin kind 'sampler'.*attention, kv_cache, model"):
        Registry(load_entry_points=False).names("sampler")


def test_explicit_choice_that_cannot_serve_raises_with_its_reasons(cpu_target):
    reg = Registry(load_entry_points=False)
    reasons = ["needs CUDA (device is cpu)", "needs the fastlib library: pip install fastlib"]
    reg.add_plugin_module(fake_attention_module("fake_fast", {"fast": backend(10, reasons)}), "test")
    with pytest.raises(PluginUnavailableError) as err:
        reg.resolve("attention", "fast", cpu_target)
    msg = str(err.value)
    assert "attention plugin 'fast' cannot serve this config" in msg
    assert reasons[0] in msg and "pip install fastlib" in msg
    assert "Choose another" in msg and "manual" in msg and "'auto'" in msg


def test_explicit_choice_that_can_serve_is_taken_and_described(cpu_target, caplog):
    reg = Registry(load_entry_points=False)
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        res = reg.resolve("attention", "manual", cpu_target)
    assert (res.name, res.asked, res.cls) == ("manual", "manual", ManualAttention)
    assert res.describe() == "attention: asked 'manual', chose 'manual' (asked by name)"


def test_availability_check_that_raises_becomes_a_reason(cpu_target):
    def broken_check(cls, target):
        raise ValueError("boom")

    cls = type("Crashy", (ManualAttention,), {"unavailable": classmethod(broken_check)})
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(fake_attention_module("fake_crashy", {"crashy": cls}), "test")
    assert reg.reasons("attention", "crashy", cpu_target) == ["its availability check raised ValueError: boom"]


# ---------------------------------------------------------------------------------------- auto
def test_auto_walks_the_priority_list_and_logs_one_line(cpu_target, caplog):
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(fake_attention_module("fake_prio", {
        "best": backend(1000, ["needs an H100 (device is cpu)"]),
        "second": backend(900),
        "third": backend(800),
    }), "test")
    assert reg.by_priority("attention")[:3] == ["best", "second", "third"]
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        res = reg.resolve("attention", "auto", cpu_target)
    assert (res.asked, res.name) == ("auto", "second")
    assert res.skipped == {"best": ["needs an H100 (device is cpu)"]}
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoplug"]
    assert lines == ["attention: asked 'auto', chose 'second' (the highest priority (900) that can serve; "
                     "skipped best: needs an H100 (device is cpu))"]


def test_auto_passes_over_a_plugin_that_asks_it_while_another_serves_and_takes_it_when_none_does(cpu_target, caplog):
    """A plugin's `passed_over` (e.g. xformers while drafts are verified) sends "auto" to the next that can serve;
    alone, it is still chosen, saying why it would have been passed over; by name it is taken with a warning."""
    slow = type("Slow", (backend(1000),), {"passed_over": classmethod(
        lambda cls, target: ["gathers keys"] if target.decode_query_len > 1 else [])})
    reg = Registry(load_entry_points=False)
    reg.entries["attention"].clear()
    reg.add_plugin_module(fake_attention_module("fake_over", {
        "slow": slow,
        "plain": backend(900), "cuda": backend(950, ["needs CUDA"]),
    }), "test")
    assert reg.resolve("attention", "auto", cpu_target).name == "slow"
    speculating = dataclasses.replace(cpu_target, decode_query_len=5)
    res = reg.resolve("attention", "auto", speculating)
    assert res.name == "plain"
    assert res.skipped == {"slow": ["passed over: gathers keys"], "cuda": ["needs CUDA"]}
    reg.entries["attention"].pop("plain")
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        res = reg.resolve("attention", "auto", speculating)
        assert reg.resolve("attention", "slow", speculating).name == "slow"
    assert res.name == "slow" and res.skipped == {"cuda": ["needs CUDA"]}
    lines = [r.getMessage() for r in caplog.records if r.name == "nanoplug"]
    assert lines[0] == ("attention: asked 'auto', chose 'slow' (the only one that can serve, although gathers keys; "
                        "skipped cuda: needs CUDA)")
    assert lines[-1] == "attention plugin 'slow' serves this config, but gathers keys"


def test_xformers_is_passed_over_for_an_engine_that_verifies_drafts():
    from nanoplug.plugins.attention.xformers import XformersAttention

    cuda = Target(device=torch.device("cuda"), dtype=torch.bfloat16, block_size=256)
    assert XformersAttention.passed_over(cuda) == []
    why = XformersAttention.passed_over(dataclasses.replace(cuda, decode_query_len=5))
    assert len(why) == 1 and "attention='flash' or 'triton'" in why[0]


def test_auto_with_no_candidate_raises_listing_every_reason(cpu_target):
    reg = Registry(load_entry_points=False)
    reg.entries["attention"].clear()
    reg.add_plugin_module(fake_attention_module("fake_none", {
        "a": backend(2, ["needs CUDA"]), "b": backend(1, ["needs float16", "head size 16 unsupported"]),
    }), "test")
    with pytest.raises(PluginUnavailableError) as err:
        reg.resolve("attention", "auto", cpu_target)
    assert str(err.value) == ("no attention plugin can serve this config: a: needs CUDA; "
                              "b: needs float16, head size 16 unsupported")


def test_auto_with_an_empty_kind_says_none_is_installed(cpu_target):
    reg = Registry(load_entry_points=False)
    reg.entries["adapter"].clear()
    with pytest.raises(PluginUnavailableError, match="no adapter plugin can serve this config: none is installed"):
        reg.resolve("adapter", "auto", cpu_target)


# -------------------------------------------------------------------------------- entry points
def test_entry_point_plugin_is_found_with_its_distribution(entry_points, cpu_target):
    groups = entry_points([FakeEntryPoint("ep_fast", fake_attention_module("ep_fast_mod", {"fast": backend(5)}))])
    reg = Registry(load_entry_points=True)
    assert groups == ["nanoplug"]
    entry = reg.entries["attention"]["fast"]
    assert entry.source == "fake-dist 1.2" and entry.cls.priority == 5
    assert reg.resolve("attention", "fast", cpu_target).name == "fast"
    assert reg.broken == []


def test_api_version_mismatch_is_reported_and_its_plugins_are_not_added(entry_points, cpu_target, caplog):
    old = fake_attention_module("old_mod", {"old": backend(5)}, api_version=0)
    unversioned = fake_attention_module("unversioned_mod", {"noversion": backend(5)}, api_version=None)
    entry_points([FakeEntryPoint("old_plugin", old), FakeEntryPoint("plain_plugin", unversioned)])
    with caplog.at_level(logging.WARNING, logger="nanoplug"):
        reg = Registry(load_entry_points=True)
    assert "old" not in reg.entries["attention"] and "noversion" not in reg.entries["attention"]
    errors = {b.name: b.error for b in reg.broken}
    assert "NANOPLUG_API_VERSION = 0" in errors["old_plugin"]
    assert f"speaks plugin API {PLUGIN_API_VERSION}" in errors["old_plugin"]
    assert "NANOPLUG_API_VERSION = None" in errors["plain_plugin"]
    assert any("old_plugin" in r.getMessage() for r in caplog.records)
    with pytest.raises(PluginLoadError, match="'old_plugin' from fake-dist 1.2 failed to load: PluginLoadError"):
        reg.get("attention", "old_plugin")
    with pytest.raises(UnknownPluginError, match="plugins that failed to load: old_plugin, plain_plugin"):
        reg.get("attention", "old")


def test_api_version_mismatch_raises_when_added_directly():
    reg = Registry(load_entry_points=False)
    with pytest.raises(PluginLoadError, match="declares NANOPLUG_API_VERSION = 99"):
        reg.add_plugin_module(fake_attention_module("future_mod", {"future": backend(1)}, api_version=99), "test")
    assert "future" not in reg.entries["attention"]


def test_plugin_that_fails_to_import_is_reported_and_others_still_load(entry_points, tmp_path, monkeypatch):
    (tmp_path / "exploding_plugin_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib.metadata.EntryPoint("exploding", "exploding_plugin_mod", "nanoplug")
    good = FakeEntryPoint("good", fake_attention_module("good_mod", {"good": backend(1)}))
    entry_points([ep, good])
    reg = Registry(load_entry_points=True)
    (broken,) = reg.broken
    assert broken.name == "exploding" and broken.error == "RuntimeError: boom at import"
    assert broken.source == "entry point exploding_plugin_mod"
    assert "good" in reg.entries["attention"]
    with pytest.raises(PluginLoadError, match="'exploding' .* failed to load: RuntimeError: boom at import"):
        reg.get("attention", "exploding")


@pytest.mark.parametrize("make_module, expected", [
    (lambda: _module_with_hook("nanoplug_register_atention"), "nanoplug_register_atention"),
    (lambda: _module_with_hook(None), "registers no plugin"),
    (lambda: fake_attention_module("not_a_class", {"x": lambda: None}), "must be a class"),
    (lambda: fake_attention_module("auto_named", {"auto": backend(1)}), "name 'auto' is invalid"),
])
def test_malformed_plugin_modules_are_reported(entry_points, make_module, expected):
    entry_points([FakeEntryPoint("bad", make_module()),
                  FakeEntryPoint("good", fake_attention_module("good_mod2", {"good": backend(1)}))])
    reg = Registry(load_entry_points=True)
    assert [b.name for b in reg.broken] == ["bad"] and expected in reg.broken[0].error
    assert "good" in reg.entries["attention"]  # a bad plugin leaves the plugin manager usable


def _module_with_hook(hook_name):
    module = types.ModuleType("odd_mod")
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION
    if hook_name:
        setattr(module, hook_name, hookimpl(lambda register: register.add("odd", backend(1))))
    return module


def test_hook_that_raises_midway_adds_nothing(entry_points):
    module = types.ModuleType("half_mod")
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION

    @hookimpl
    def nanoplug_register_attention(register):
        register.add("half", backend(1))
        raise RuntimeError("second backend failed")

    module.nanoplug_register_attention = nanoplug_register_attention
    entry_points([FakeEntryPoint("half", module)])
    reg = Registry(load_entry_points=True)
    assert "half" not in reg.entries["attention"]
    assert reg.broken[0].error == "RuntimeError: second backend failed"


def test_third_party_may_replace_a_builtin_when_it_says_so_and_a_later_builtin_import_keeps_it(entry_points, caplog):
    mine = backend(1, description="my manual")
    entry_points([FakeEntryPoint("mine", fake_attention_module("mine_mod", {"manual": mine}, replace=True))])
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        reg = Registry(load_entry_points=True)
    assert "attention plugin 'manual' from fake-dist 1.2 replaces the one from built-in (replace=True)" in caplog.text
    assert reg.broken == [] and reg.entries["attention"]["manual"].source == "fake-dist 1.2"
    import nanoplug.plugins.attention.manual as builtin_manual  # noqa: F401  (importing a built-in changes nothing)

    assert reg.get("attention", "manual") is mine
    assert reg.get("attention", "sdpa").__module__ == "nanoplug.plugins.attention.sdpa"  # others stay built-in


def test_each_builtin_is_declared_once():
    """registry.toml is the one declaration: no built-in module implements a registrar hook too."""
    import importlib

    from nanoplug.api.hookspecs import KIND_HOOKS as HOOKS

    reg = Registry(load_entry_points=False)
    for kind, entries in reg.entries.items():
        for name, entry in entries.items():
            module = importlib.import_module(entry.target.partition(":")[0])
            assert not any(hasattr(module, hook) for hook in HOOKS.values()), (kind, name)
            assert not hasattr(reg.get(kind, name), "architectures"), (kind, name)


@pytest.mark.parametrize("value, enabled", [("1", False), ("true", False), ("YES", False), ("0", True), ("", True)])
def test_env_switch_turns_entry_points_off(entry_points, monkeypatch, value, enabled):
    entry_points([FakeEntryPoint("ep_fast", fake_attention_module("ep_fast_mod2", {"fast": backend(5)}))])
    monkeypatch.setenv("NANOPLUG_DISABLE_ENTRY_POINTS", value)
    assert ("fast" in Registry().entries["attention"]) is enabled
    assert "fast" in Registry(load_entry_points=True).entries["attention"]  # an explicit argument wins


def test_default_registry_is_shared():
    assert default_registry() is default_registry()


# ------------------------------------------------------------------------------ in the engine
class SpyAttention(ManualAttention):
    """The manual backend, counting its calls: shows which engine used which backend."""

    calls = 0

    def forward(self, *args):
        SpyAttention.calls += 1
        return super().forward(*args)


ENGINE_OPTIONS = dict(kv_cache="torch", kv_block_size=16, max_model_len=128, num_kv_blocks=16)


def test_choice_is_per_engine_instance(qwen3_dir):
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(fake_attention_module("spy_mod", {"spy": SpyAttention}), "test")
    spy_engine = LLM(str(qwen3_dir), registry=reg, attention="spy", **ENGINE_OPTIONS)
    manual_engine = LLM(str(qwen3_dir), registry=reg, attention="manual", **ENGINE_OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=3)
    SpyAttention.calls = 0
    from_manual = manual_engine.generate(["Hello there"], params, use_tqdm=False)
    assert SpyAttention.calls == 0
    from_spy = spy_engine.generate(["Hello there"], params, use_tqdm=False)
    assert SpyAttention.calls > 0
    assert from_spy[0].token_ids == from_manual[0].token_ids
    assert spy_engine.choices["attention"].name == "spy" and manual_engine.choices["attention"].name == "manual"
    assert "attention: asked 'spy', chose 'spy'" in "\n".join(spy_engine.describe_plugins())


def test_engine_rejects_unknown_and_unservable_plugins_by_name(qwen3_dir):
    reg = Registry(load_entry_points=False)
    reg.add_plugin_module(fake_attention_module("gpu_only_mod", {"gpu_only": backend(1, ["needs CUDA"])}), "test")
    with pytest.raises(UnknownPluginError, match="unknown kv_cache plugin 'nope'; valid names: .*torch"):
        LLM(str(qwen3_dir), registry=reg, **{**ENGINE_OPTIONS, "kv_cache": "nope"})
    with pytest.raises(PluginUnavailableError, match="attention plugin 'gpu_only' cannot serve this config: needs CUDA"):
        LLM(str(qwen3_dir), registry=reg, attention="gpu_only", **ENGINE_OPTIONS)


# ------------------------------------------------------------------------------- weight formats
def test_auto_weight_format_keeps_a_checkpoint_format_where_it_can_serve_and_says_why_not(cpu_target):
    from nanoplug.engine.startup import auto_weight_format

    reg = Registry(load_entry_points=False)
    assert auto_weight_format(reg, None, cpu_target).name == "dense"  # plain weights: never fp8 by "auto"
    assert auto_weight_format(reg, "gguf", cpu_target).name == "gguf"  # the CPU's C++ kernels
    bf16 = Target(device=torch.device("cpu"), dtype=torch.bfloat16)
    res = auto_weight_format(reg, "gguf", bf16)
    assert res.name == "dense" and set(res.skipped) >= {"gguf", "gguf_triton"}
    assert "it computes in float32, not bfloat16 (pass dtype='float32')" in res.skipped["gguf"]
    assert "weight_format: asked 'auto', chose 'dense'" in res.describe() and "skipped gguf:" in res.describe()
    merged = auto_weight_format(reg, "gguf", cpu_target, merged=True)
    assert merged.name == "dense" and "a merged adapter changes the weights" in merged.skipped["gguf"][-1]
    assert auto_weight_format(reg, "awq", cpu_target).name == "awq"
    # a format nothing keeps cannot be dequantized by the loader either (only GGUF is): refused, saying what serves
    with pytest.raises(PluginUnavailableError, match="stored as 'bitsandbytes'.*no weight_format plugin keeps "
                                                     "'bitsandbytes' weights.*nanoplug keeps awq, compressed-tensors"):
        auto_weight_format(reg, "bitsandbytes", cpu_target)


def test_a_weight_format_asked_by_name_that_cannot_serve_says_why(qwen3_dir):
    from nanoplug import LLM

    reg = Registry(load_entry_points=False)
    options = dict(registry=reg, device="cpu", dtype="float32", max_model_len=64, cpu={"kv_cache_gb": 0.01})
    with pytest.raises(UnknownPluginError, match="unknown weight_format plugin 'int4'; valid names: awq, compressed_tensors, dense, fp8, fp8_checkpoint, gguf"):
        LLM(str(qwen3_dir), quantization="int4", **options)
    with pytest.raises(PluginUnavailableError, match="keeps 'gguf' checkpoints' weights, but .* holds plain weights"):
        LLM(str(qwen3_dir), quantization="gguf", **options)
    with pytest.raises(PluginUnavailableError, match="its C++ kernels run on the CPU|computes in float32"):
        LLM(str(qwen3_dir), quantization="gguf", **{**options, "dtype": "bfloat16"})


def test_an_adapter_of_the_old_contract_that_gives_a_linear_method_is_refused():
    from nanoplug.api import WeightAdapter
    from nanoplug.engine.registry import Registrar

    class OldFormat(WeightAdapter):
        def linear_method(self):
            return None

    with pytest.raises(PluginLoadError, match="register a weight format as a nanoplug.api.WeightFormat"):
        Registrar("adapter").add("old", OldFormat)
