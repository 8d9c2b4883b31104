"""Where the weights come from: a local folder, or a Hugging Face model id fetched where the network allows.

Offline (HF_HUB_OFFLINE=1, or no network) an id still resolves when huggingface_hub's local cache
holds it; otherwise the error says the machine is offline and names the local-folder alternative.
"""
from __future__ import annotations

import os
from pathlib import Path

from nanoplug.errors import ModelLoadError

CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]


def looks_like_hub_id(model: str) -> bool:
    """"owner/name" that is not an existing path and not spelled like one."""
    return (model.count("/") == 1 and not model.startswith((".", "/", "~"))
            and not Path(model).expanduser().exists() and all(model.split("/")))


def gguf_folder(path: Path) -> Path:
    """The checkpoint folder of a GGUF file (its config and tokenizer built once, kept in the cache)."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    from nanoplug.api.disk_cache import cache_root
    from nanoplug.checkpoint.gguf_file import checkpoint_folder

    return checkpoint_folder(path, cache_root() / "gguf")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _local_alternative(model: str) -> str:
    name = model.split("/")[-1]
    return (f"download it where the network allows (huggingface-cli download {model} --local-dir {name}) and pass "
            f"the local folder instead: LLM('/path/to/{name}') or nanoplug generate --model /path/to/{name}")


def resolve_model_path(model: str | os.PathLike) -> str:
    """A local checkpoint folder for `model` (a folder path, a GGUF file, or an id like "Qwen/Qwen3-0.6B")."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return str(gguf_folder(path))
    if isinstance(model, os.PathLike):  # a pathlib.Path names a folder, never a hub id
        return str(path)
    if not looks_like_hub_id(model):
        return str(path)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelLoadError(
            f"{model!r} is not a local folder, and huggingface_hub is not installed to fetch it: "
            f"pip install huggingface_hub, or pass the path of a downloaded checkpoint folder"
        ) from exc
    offline = hub_offline()
    try:
        # local_files_only follows the environment now, not the value huggingface_hub read at import
        return snapshot_download(model, allow_patterns=CHECKPOINT_FILES, local_files_only=offline)
    except Exception as exc:
        why = ("this machine is offline (HF_HUB_OFFLINE is set) and the model is not in the local Hugging Face cache" if offline
               else f"this machine looks offline or the hub refused ({type(exc).__name__}: {exc})")
        raise ModelLoadError(
            f"{model!r} is not a local folder and could not be fetched from the Hugging Face hub: {why}; "
            + _local_alternative(model)
        ) from exc
