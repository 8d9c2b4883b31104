"""`nanoplug plugins`: every kind with its built-ins, availability judged for a target, broken plugins.

The subprocess tests run the real command line; a broken third-party plugin is a real distribution
(a dist-info folder with an entry point) put on PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _processes
from nanoplug.cli import main

KINDS = ["attention", "kv_cache", "model", "parallel", "adapter", "weight_format", "platform", "structured_output",
         "speculator"]


def run_cli(*args: str, extra_path: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    if extra_path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), full_env.get("PYTHONPATH")]))
    return _processes.run([sys.executable, "-m", "nanoplug", "plugins", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


@pytest.fixture(scope="module")
def broken_dist(tmp_path_factory) -> Path:
    """A folder holding an installed-looking distribution whose entry-point module raises on import."""
    root = tmp_path_factory.mktemp("broken_dist")
    (root / "exploding_nanoplug_plugin.py").write_text("raise ImportError('needs libfoo: pip install foo')\n")
    info = root / "exploding_nanoplug_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: exploding-nanoplug-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[nanoplug]\nexploding = exploding_nanoplug_plugin\n")
    return root


def check_listing(data: dict) -> None:
    """What every listing must hold, whatever else is installed."""
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert data["target"]["device"].startswith(expected_device)
    assert list(data["kinds"]) == KINDS
    by_name = {k: {p["name"]: p for p in v["plugins"]} for k, v in data["kinds"].items()}
    assert {"manual", "sdpa", "flash", "xformers"} <= set(by_name["attention"])
    assert {"torch", "triton"} <= set(by_name["kv_cache"]) and "single" in by_name["parallel"]
    assert "Qwen3ForCausalLM" in by_name["model"] and "lora" in by_name["adapter"]
    assert {"dense", "gguf", "gguf_triton", "fp8"} <= set(by_name["weight_format"])
    for kind, plugins in by_name.items():
        for p in plugins.values():
            assert set(p) == {"name", "source", "available", "reasons", "description", "priority", "notes"}
            assert p["available"] == (p["reasons"] == []), p
    for name in ("manual", "sdpa"):
        p = by_name["attention"][name]
        assert p["available"] and p["source"] == "built-in" and p["description"]
    assert by_name["kv_cache"]["torch"]["available"] and by_name["parallel"]["single"]["available"]
    available = [p for p in data["kinds"]["attention"]["plugins"] if p["available"]]
    assert data["kinds"]["attention"]["auto"] == max(available, key=lambda p: p["priority"])["name"]
    platforms = by_name["platform"]  # listed with their reasons like every kind
    assert {"cpu", "cuda"} <= set(platforms) and data["kinds"]["platform"]["auto"] == expected_device
    assert any("weight_packing" in n or "not measured yet" in n for n in platforms["cpu"]["notes"])  # choices per CPU
    other = "cpu" if expected_device == "cuda" else "cuda"
    assert platforms[other]["reasons"] == [f"serves {other} devices, not {expected_device}"]


def test_json_through_python_dash_m():
    result = run_cli("--json")
    assert result.returncode == 0, result.stderr
    check_listing(json.loads(result.stdout))


def test_console_script_prints_every_kind_with_status_and_source():
    script = shutil.which("nanoplug") or str(Path(sys.executable).parent / "nanoplug")
    assert Path(script).exists(), "the `nanoplug` console script is not installed: pip install -e ."
    result = _processes.run([script, "plugins"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("judged for device ")
    for kind in KINDS:
        assert f"\n{kind}" in out
    manual_line = next(line for line in out.splitlines() if line.strip().startswith("manual "))
    assert "available" in manual_line and "unavailable" not in manual_line and "[built-in]" in manual_line


def test_broken_third_party_plugin_is_listed_with_its_error(broken_dist):
    data = json.loads(run_cli("--json", extra_path=broken_dist).stdout)
    check_listing(data)
    assert {"name": "exploding", "source": "exploding-nanoplug-plugin 0.3",
            "error": "ImportError: needs libfoo: pip install foo"} in data["broken"]
    text = run_cli(extra_path=broken_dist)
    assert "broken plugins (failed to load)" in text.stdout
    assert "exploding  [exploding-nanoplug-plugin 0.3]  ImportError: needs libfoo" in text.stdout
    assert "failed to load" in text.stderr  # the registry's warning


def test_env_switch_hides_third_party_plugins(broken_dist, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(broken_dist))
    monkeypatch.syspath_prepend(str(broken_dist))
    monkeypatch.setenv("NANOPLUG_DISABLE_ENTRY_POINTS", "1")
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["broken"] == []
    assert all(p["source"] == "built-in" for k in data["kinds"].values() for p in k["plugins"])


def test_unbuilt_builtin_shows_its_import_error(monkeypatch, capsys):
    from nanoplug.engine import registry as registry_module

    original_init = registry_module.Registry.__init__

    def with_ghost(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.entries["attention"]["ghost"] = registry_module.PluginEntry(
            "attention", "ghost", "built-in", target="nanoplug.plugins.attention.ghost_absent:Ghost")

    monkeypatch.setattr(registry_module.Registry, "__init__", with_ghost)
    assert main(["plugins", "--json"]) == 0
    ghost = next(p for p in json.loads(capsys.readouterr().out)["kinds"]["attention"]["plugins"] if p["name"] == "ghost")
    assert not ghost["available"] and "No module named 'nanoplug.plugins.attention.ghost_absent'" in ghost["reasons"][0]
    assert main(["plugins"]) == 0
    assert "ghost" in capsys.readouterr().out


def test_judged_against_a_checkpoint_dtype_and_device(qwen3_dir, capsys):
    assert main(["plugins", "--json", "--model", str(qwen3_dir), "--device", "cpu", "--dtype", "bfloat16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"] == {"device": "cpu", "dtype": "bfloat16", "model": str(qwen3_dir),
                              "architecture": "Qwen3ForCausalLM"}
    assert data["kinds"]["model"]["auto"] == "Qwen3ForCausalLM"
    assert data["kinds"]["adapter"]["auto"] is None  # adapters are named by the user, never auto-picked
    assert data["kinds"]["weight_format"]["auto"] == "dense"  # plain weights; fp8 only when asked by name


def test_bad_target_option_is_a_clear_error(capsys):
    assert main(["plugins", "--device", "gpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanoplug plugins: error:") and "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'" in err


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["plugins", "--model", str(tmp_path / "absent")]) == 2
    assert "nanoplug: error:" in capsys.readouterr().err
