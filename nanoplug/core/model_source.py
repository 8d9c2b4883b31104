"""Where the weights come from: a local folder, or a Hugging Face model id fetched where the network allows."""
from __future__ import annotations

from pathlib import Path

from nanoplug.core.errors import ModelLoadError


def resolve_model_path(model: str) -> str:
    """A local checkpoint folder for `model` (a folder path, or an id like "Qwen/Qwen3-0.6B")."""
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        return str(path)
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelLoadError(
            f"{model!r} is not a local folder, and huggingface_hub is not installed to fetch it: "
            f"pip install huggingface_hub, or pass the path of a downloaded checkpoint folder"
        ) from exc
    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as exc:
        raise ModelLoadError(
            f"could not fetch {model!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            f"this machine may be offline: download the checkpoint elsewhere and pass its local folder, "
            f"e.g. LLM('/path/to/{model.split('/')[-1]}')"
        ) from exc
