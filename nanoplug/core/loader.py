"""Reads a Hugging Face checkpoint folder: its config, and its safetensors weights into a model,
passing every tensor through the chosen weight adapters on the way."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open

from nanoplug.core.errors import ModelLoadError


def checkpoint_dir(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {str(folder)!r} does not exist; pass a folder holding config.json and *.safetensors")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{str(folder / 'config.json')!r} is missing; the model folder must be a Hugging Face checkpoint")
    return folder


def load_hf_config(path: str | Path) -> Any:
    from transformers import AutoConfig

    folder = checkpoint_dir(path)
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # an unknown model_type still has a usable config.json
        with open(folder / "config.json") as f:
            raw = json.load(f)
        from transformers import PretrainedConfig

        cfg = PretrainedConfig(**raw)
        if not getattr(cfg, "architectures", None):
            raise ModelLoadError(f"{folder / 'config.json'} has no 'architectures' entry: {exc}") from exc
        return cfg


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: the sharded index's files, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {str(folder)!r}; convert the checkpoint to safetensors first")
    return files


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: torch.nn.Module, folder: str | Path, adapters: Iterable[Any] = ()) -> None:
    """Copy every checkpoint tensor (after the adapters) into its parameter, packing fused layers."""
    folder = checkpoint_dir(folder)
    adapters = list(adapters)
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(folder):
        for adapter in adapters:
            tensor = adapter.transform(name, tensor)
        target, shard = name, None
        for source, (fused, shard_id) in packed.items():
            if f".{source}." in name:
                target, shard = name.replace(f".{source}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        if param is None:
            continue  # e.g. a tied lm_head.weight, or buffers like rotary inv_freq
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        loaded.add(target)
    for adapter in adapters:
        adapter.finish()
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(
            f"checkpoint {str(folder)!r} lacks {len(missing)} weights the model needs, e.g. {', '.join(missing[:5])}"
        )
