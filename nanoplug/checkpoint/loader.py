"""Reads a Hugging Face checkpoint folder: its config, and its safetensors weights into a model,
passing every tensor through the chosen adapters (LoRA merges) and weight format on the way.

Nothing in the folder is taken on trust. A config.json or shard index that is not what transformers
writes, a damaged safetensors file, a shard index naming a file outside the folder, and a tensor
whose shape differs from what the config builds each stop the load with a ModelLoadError that names
the file and the fix, before a wrong weight can give wrong tokens. Like vLLM's loaders, every weight
loader checks the shape of what it copies; a tensor the model has no place for is named (an error
where it means the weights are of another architecture or config, a warning otherwise).

The weights are the folder's safetensors, or one GGUF file (a folder made by `gguf_file.checkpoint_folder`
or the default model's). A GGUF tensor of a type the chosen weight format lists in its `kept_types`
reaches the layers as it is in the file (a `GGUFTensor`: its blocks, for that format's linear method to
keep); every other tensor is dequantized by gguf-py to float32 first, so the dense path loads any GGUF file.
"""
from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from nanoplug.api.files import read_json
from nanoplug.api.linear import check_shape, copy_weight  # noqa: F401  (every weight loader's shape check)
from nanoplug.checkpoint import resolved_config
from nanoplug.errors import ModelLoadError, WeightShapeError

log = logging.getLogger("nanoplug")

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FIX = "fix it, or write it again with config.save_pretrained(folder)"
WEIGHTS_FIX = ("the file is damaged or incomplete (an interrupted download or copy?): download or save the "
               "checkpoint again")
INDEX_FIX = (f"write the checkpoint again with save_pretrained, or delete {INDEX_FILE} when the folder holds one "
             "model.safetensors")
SHAPE_FIX = ("config.json does not describe these weights: use the config.json saved with them, or weights saved "
             "for this config")
# config.json settings the model's shapes are built from: each, when set, a positive integer
SHAPE_SETTINGS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
# checkpoint tensors no model needs: rotary tables some exporters save (vLLM skips the same ones)
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


# ------------------------------------------------------------------------------------ config
def checkpoint_dir(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {str(folder)!r} does not exist; pass a folder holding config.json and *.safetensors")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{str(folder / 'config.json')!r} is missing; the model folder must be a Hugging Face checkpoint")
    return folder


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def load_hf_config(path: str | Path) -> Any:
    """The checkpoint's transformers config, after checking the settings the model's shapes come from."""
    folder = checkpoint_dir(path)
    file = folder / "config.json"
    raw = read_json(file, CONFIG_FIX)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{str(file)!r} holds a JSON {_json_type(raw)}, not an object of settings; {CONFIG_FIX}")
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs)):
        raise ModelLoadError(f"{str(file)!r}: 'architectures' must be a list of class names such as "
                             f"[\"Qwen3ForCausalLM\"], found {archs!r}; {CONFIG_FIX}")
    if not isinstance(raw.get("model_type", ""), str):
        raise ModelLoadError(f"{str(file)!r}: model_type must be a string such as \"qwen3\", found "
                             f"{raw['model_type']!r}; {CONFIG_FIX}")
    _check_shape_settings(raw.get, file)  # before transformers, whose own checks word it less plainly
    data = file.read_bytes()
    cfg = resolved_config.load(data)  # this very config.json read before: no config class imported
    if cfg is None:
        cfg = _transformers_config(folder, file, raw)
        resolved_config.keep(data, cfg)
    _check_shape_settings(lambda key: getattr(cfg, key, None), file)  # defaults included
    return cfg


def _transformers_config(folder: Path, file: Path, raw: dict) -> Any:
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    try:
        if raw.get("model_type") in CONFIG_MAPPING:
            cfg = AutoConfig.from_pretrained(str(folder))
        else:  # a model_type transformers does not know: its raw settings still serve a model plugin
            cfg = PretrainedConfig(**raw)
    except Exception as exc:
        raise ModelLoadError(f"{str(file)!r} is not a config transformers can read ({type(exc).__name__}: {exc}); "
                             f"{CONFIG_FIX}") from exc
    if not getattr(cfg, "architectures", None) and raw.get("model_type") not in CONFIG_MAPPING:
        raise ModelLoadError(f"{str(file)!r} has no 'architectures' entry, and transformers does not know its "
                             f"model_type {raw.get('model_type')!r}; add \"architectures\": [\"...ForCausalLM\"]")
    return cfg


def _check_shape_settings(get: Any, file: Path) -> None:
    for key in SHAPE_SETTINGS:
        value = get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ModelLoadError(f"{str(file)!r}: {key} must be a positive integer, found {value!r}; {CONFIG_FIX}")


# ------------------------------------------------------------------------------- weight files
def _allowed_roots(folder: Path) -> list[Path]:
    """Where a shard may really live: the folder, and for a Hugging Face cache snapshot
    (models--org--name/snapshots/REV, whose files are symlinks into ../../blobs) that repo's blobs."""
    real = folder.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def _shard_path(folder: Path, name: str, index: Path) -> Path:
    """The file an index entry names, refused unless it lies inside the model folder."""
    refuse = (f"{str(index)!r} names shard {name!r}, {{}}; a shard index may only name files inside the model "
              f"folder {str(folder)!r}, so it is not read ({INDEX_FIX})")
    rel = PurePosixPath(name.replace("\\", "/"))
    if rel.is_absolute() or Path(name).is_absolute() or ".." in rel.parts:
        raise ModelLoadError(refuse.format("a path outside the model folder"))
    file = folder.joinpath(*rel.parts)
    if file.exists() and not any(file.resolve().is_relative_to(root) for root in _allowed_roots(folder)):
        raise ModelLoadError(refuse.format(f"a symlink leading out of the folder (to {str(file.resolve())!r})"))
    return file


def _index_shards(folder: Path, index: Path) -> list[Path]:
    data = read_json(index, INDEX_FIX)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{str(index)!r} has no 'weight_map' object (tensor name -> shard file); {INDEX_FIX}")
    bad = [f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str) or not v.strip()]
    if bad:
        raise ModelLoadError(f"{str(index)!r}: weight_map values must name shard files, found {', '.join(bad[:3])}; "
                             f"{INDEX_FIX}")
    names = sorted(set(weight_map.values()))
    files = [_shard_path(folder, n, index) for n in names]
    missing = [n for n, f in zip(names, files) if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index} names shard files that are missing: {', '.join(missing)}")
    return files


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: the sharded index's files, or every *.safetensors.

    Only index entries are checked for where they lead: a file the glob finds is named by the folder
    itself, and a symlink placed there is its owner's choice (the Hugging Face cache is built of them)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return _index_shards(folder, index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {str(folder)!r}; convert the checkpoint to safetensors first")
    return files


def iter_checkpoint(folder: Path, kept_types: frozenset[str] = frozenset()) -> Iterator[tuple[Path, str, Any]]:
    """(file, name, tensor) of every tensor; a file safetensors cannot read is a ModelLoadError naming it.
    A GGUF folder's tensors of a type in `kept_types` come as GGUFTensors (their blocks), others dequantized."""
    from nanoplug.checkpoint.gguf_file import GGUFFile, gguf_in

    gguf = gguf_in(folder)
    if gguf is not None:
        for t in GGUFFile(gguf).tensors():
            yield gguf, t.name, t if t.type_name in kept_types else t.dequantize()
        return
    for file in safetensors_files(folder):
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{str(file)!r} is not a readable safetensors file ({exc}); {WEIGHTS_FIX}") from exc
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ModelLoadError(
                        f"tensor {name!r} of {str(file)!r} cannot be read ({exc}); {WEIGHTS_FIX}") from exc
                yield file, name, tensor


# ------------------------------------------------------------------------------ shape checks
# ------------------------------------------------------------------------------------ loading
def _fused_parts(packed: dict[str, tuple[str, Any]]) -> dict[str, dict[Any, str]]:
    """fused layer -> {shard id: checkpoint module}, e.g. qkv_proj -> {"q": "q_proj", ...}."""
    parts: dict[str, dict[Any, str]] = {}
    for source, (fused, shard) in packed.items():
        parts.setdefault(fused, {})[shard] = source
    return parts


def _no_place(modules: dict[str, torch.nn.Module], target: str) -> bool:
    """True when a tensor the model lacks belongs to a module it builds (a bias the config switches off,
    a norm another architecture has) or to one of its layer lists (more layers than the config says):
    loading around it would compute something else than the checkpoint was trained to."""
    module_path = target.rpartition(".")[0]
    if not module_path:
        return False
    if module_path in modules:
        return True
    return any(target.startswith(n + ".") for n, m in modules.items() if n and isinstance(m, torch.nn.ModuleList))


def _loader_error(exc: Exception, name: str, file: Path, target: str) -> ModelLoadError:
    if isinstance(exc, WeightShapeError):
        detail = getattr(exc, "detail", str(exc))
        return WeightShapeError(f"checkpoint tensor {name!r} in {str(file)!r} has {detail}; {SHAPE_FIX}")
    why = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
    return ModelLoadError(f"checkpoint tensor {name!r} in {str(file)!r} cannot be loaded into {target}: {why}")


def _load_one(param: torch.nn.Parameter, tensor: Any, shard: Any) -> bool:
    """Load one tensor; True when it came in a weight format's blocks and was dequantized for a dense parameter
    (an MoE's experts, which the GGUF formats' 2-D kernels do not serve)."""
    dequantized = param.is_floating_point() and not isinstance(tensor, torch.Tensor)
    if dequantized:
        tensor = tensor.dequantize()
    if param.is_floating_point() and not tensor.is_floating_point():
        raise ModelLoadError(f"it holds {str(tensor.dtype).removeprefix('torch.')} values where the model expects "
                             "floating-point weights (a quantized checkpoint needs its weight format)")
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        copy_weight(param.data, tensor)
    elif shard is not None:
        loader(param, tensor, shard)
    else:
        loader(param, tensor)
    return dequantized


def load_weights(model: torch.nn.Module, folder: str | Path, adapters: Iterable[Any] = (),
                 weight_format: Any = None) -> None:
    """Copy every checkpoint tensor (after the adapters, then the weight format) into its parameter, packing
    fused layers. `weight_format` (a WeightFormat; None: dense) says which GGUF tensors stay as stored."""
    folder = checkpoint_dir(folder)
    adapters = list(adapters)
    # a parameter filled through another (an MoE's experts kept in a weight format: each expert's layers through
    # the experts' `weight`) is not looked for by its own name
    params = {n: p for n, p in model.named_parameters() if not hasattr(p, "loaded_through")}
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)  # e.g. a tied lm_head
    packed = getattr(model, "packed_modules_mapping", {})
    fused = _fused_parts(packed)
    modules = dict(model.named_modules())
    loaded: dict[str, set[Any]] = {}  # parameter -> shards loaded (None: the whole tensor)
    no_place: list[str] = []  # tensors of modules the model builds, but has no parameter for
    unused: list[str] = []  # tensors of modules the model does not have at all
    dequantized: list[str] = []  # tensors kept in their blocks that a dense parameter took as values
    transforms = [a.transform for a in adapters] + ([weight_format.transform] if weight_format is not None else [])
    kept = weight_format.kept_types if weight_format is not None else frozenset()
    stream = iter_checkpoint(folder, kept)
    for file, name, tensor in (weight_format.regroup(stream) if weight_format is not None else stream):
        for transform in transforms:
            tensor = transform(name, tensor)
        target, shard = name, None
        for source, (fused_name, shard_id) in packed.items():
            if f".{source}." in name:
                target, shard = name.replace(f".{source}.", f".{fused_name}."), shard_id
                break
        param = params.get(target)
        if param is None:
            if target in aliases or name.endswith(HARMLESS_SUFFIXES):
                continue
            (no_place if _no_place(modules, target) else unused).append(f"{name} ({file.name})")
            continue
        try:
            with torch.no_grad():
                if _load_one(param, tensor, shard):
                    dequantized.append(name)
        except (ModelLoadError, ValueError, RuntimeError) as exc:
            if isinstance(exc, torch.OutOfMemoryError):
                raise
            raise _loader_error(exc, name, file, target) from exc
        loaded.setdefault(target, set()).add(shard)
    if dequantized:
        log.info("%d quantized checkpoint tensor(s) dequantized at load for layers the weight format %s does not "
                 "serve (its kernels are 2-D; e.g. an MoE's experts): %s", len(dequantized),
                 type(weight_format).__name__, ", ".join(dequantized[:3]) + (", ..." if len(dequantized) > 3 else ""))
    for adapter in adapters:
        adapter.finish()
    if weight_format is not None:
        weight_format.finish()
    if no_place:
        raise ModelLoadError(
            f"checkpoint {str(folder)!r} holds {len(no_place)} tensor(s) this model has no parameter for, e.g. "
            f"{', '.join(no_place[:5])}: the weights are of another architecture, or config.json does not describe "
            "them (its architectures, num_hidden_layers, attention_bias...); use the config.json saved with them"
        )
    if unused:
        log.warning("checkpoint %r holds %d tensor(s) the %s model does not use; ignored: %s", str(folder),
                    len(unused), type(model).__name__, ", ".join(unused[:10]) + (", ..." if len(unused) > 10 else ""))
    missing = []
    for target in params:
        done = loaded.get(target, set())
        if None in done:
            continue
        module, _, leaf = target.rpartition(".")
        # the fused layer it belongs to: the longest fused name it ends with (an MoE's "experts.gate_up_proj")
        key = max((f for f in fused if module == f or module.endswith("." + f)), key=len, default=None)
        parts = fused[key] if key is not None else {}
        if not parts:  # a plain parameter
            missing += [] if done else [target]
            continue
        prefix = module[:len(module) - len(key)].rstrip(".")  # a fused layer needs each of its checkpoint tensors
        missing += [f"{prefix}.{parts[s]}.{leaf}".lstrip(".") for s in parts if s not in done]
    if missing:
        raise ModelLoadError(
            f"checkpoint {str(folder)!r} lacks {len(missing)} weights the model needs, e.g. {', '.join(missing[:5])}"
        )
