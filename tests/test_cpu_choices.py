"""Choices measured per CPU (nanoplug/kernels/cpu/choices.py, the cpu platform): measured briefly at the first
start and cached per CPU signature beside the kernel builds, so a second engine measures nothing; an explicit
option wins; the start-up log says what was used and where it came from; `nanoplug plugins` shows the cache."""
from __future__ import annotations

import logging

import pytest

from _checkpoints import checkpoint
from nanoplug import LLM
from nanoplug.kernels import cpu as cpu_kernels
from nanoplug.kernels.cpu import choices
from nanoplug.kernels.cpu.quant_ops import quant_kernels
from nanoplug.kernels.gguf.cpu_linear import cpu_method

ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=16, kv_block_size=16, max_model_len=64,
              cpu={"graphs": False})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh choices file (the kernel builds stay where they are: no rebuild) and a count of measurements."""
    assert cpu_kernels.unavailable() is None, "these tests need the CPU kernels (a C++ compiler)"
    monkeypatch.setattr(choices, "path", lambda: tmp_path / "choices-test.json")
    monkeypatch.setattr(choices, "NOISE", float("inf"))  # a busy test machine still caches (see the noisy test)
    calls = []
    measure = choices.measure_packing
    monkeypatch.setattr(choices, "measure_packing", lambda k: calls.append(1) or measure(k))
    return calls


def test_measured_at_the_first_start_then_cached_and_logged(cache, caplog):
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        with LLM(checkpoint(), **ENGINE) as llm:
            first = llm.engine.worker.model
        assert "cpu: for this CPU: weight_packing=" in caplog.text and "(measured:" in caplog.text
        known = choices.cached()
        assert set(known) == {"weight_packing"} and isinstance(known["weight_packing"]["weight_packing"], bool)
        packed = any(getattr(m, "packed", None) is not None for m in first.modules())
        assert packed == known["weight_packing"]["weight_packing"]
        caplog.clear()
        with LLM(checkpoint(), **ENGINE):
            pass
    assert len(cache) == 1 and "(cached:" in caplog.text


@pytest.mark.parametrize("packing", [True, False])
def test_an_explicit_option_wins_and_is_logged(cache, caplog, packing):
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        with LLM(checkpoint(), **{**ENGINE, "cpu": {"graphs": False, "weight_packing": packing}}) as llm:
            packed = any(getattr(m, "packed", None) is not None for m in llm.engine.worker.model.modules())
    assert cache == [] and choices.cached() == {}
    assert packed == packing and f"weight_packing={packing} (cpu option)" in caplog.text


@pytest.mark.parametrize("kernels", ["panels", "platform's"])
def test_the_gguf_measurement_names_a_mode_of_float32_quality(kernels):
    """Measured on the panels library and on what the platform hands it (the GGUF method's kernels, both
    libraries behind one interface: a signature of its own once broke every first GGUF start)."""
    quant = quant_kernels() if kernels == "panels" else cpu_method().kernels
    answer = choices.measure_gguf_activations(quant)
    assert answer["small"] in ("float", "int8x2") and answer["large"] in ("float", "int8x2")
    assert len(answer["ms"]["float"]) == len(answer["ms"]["int8x2"]) == len(choices.GGUF_ROWS)
    assert "gguf_activations=" in choices.describe("gguf_activations", answer, "measured")


def test_nanoplug_plugins_shows_the_cached_choices(cache):
    from nanoplug.cli.plugins import build_target, listing
    from nanoplug.engine.registry import Registry

    registry = Registry()
    row = lambda: next(p for p in listing(registry, build_target(None, "cpu", "float32", registry))["kinds"]
                       ["platform"]["plugins"] if p["name"] == "cpu")
    assert "not measured yet" in row()["notes"][0]
    with LLM(checkpoint(), **ENGINE):
        pass
    assert any(n.startswith("weight_packing=") for n in row()["notes"])


def test_a_measurement_disturbed_by_a_busy_machine_is_retried_a_few_starts_then_kept(cache, monkeypatch, caplog):
    monkeypatch.setattr(choices, "NOISE", 0.5)  # every pair of timings "differs": as on a machine at load 20
    with caplog.at_level(logging.INFO, logger="nanoplug"):
        with LLM(checkpoint(), **ENGINE) as llm:
            packed = any(getattr(m, "packed", None) is not None for m in llm.engine.worker.model.modules())
    assert "measurement was disturbed" in caplog.text and "(measured, noisy:" in caplog.text
    assert packed and choices.cached()["weight_packing"]["attempts"] == 1  # packing, as before it was measured
    for _ in range(choices.NOISY_ATTEMPTS - 1):  # measured again at the next starts, then kept
        choices.choice("weight_packing", lambda: choices.measure_packing(cpu_kernels.kernels()))
    assert len(cache) == choices.NOISY_ATTEMPTS
    assert choices.choice("weight_packing", lambda: 1 / 0)[1] == "cached"
