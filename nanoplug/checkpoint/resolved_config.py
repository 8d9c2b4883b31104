"""transformers' config of a checkpoint, kept after its first load: a later start from the same config.json,
under the same transformers release, rebuilds it without importing the architecture's config class.

Why: in transformers 5 a model's config class imports its type validators, which import the activations,
the hub kernels and torch.distributed.tensor: about half a second of every CPU start, for a config whose
reading takes a millisecond. The kept form is the instance's attributes and the class attributes its class
sets beyond PretrainedConfig's, as JSON, rebuilt on a PretrainedConfig subclass of the same name (so the
methods transformers calls on a config, such as the rope helpers' standardize_rope_params, are its own).

It is written only when the rebuilt object reads the same as transformers' own: to_dict() and every data
attribute (instance, class and property alike) equal. A config it cannot copy faithfully is not kept, and
every start of it loads through transformers, as before.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import torch

from nanoplug.api.disk_cache import cache_root

FORMAT = 1  # bump when what is kept changes
_PLAIN = (type(None), bool, int, float, str, list, dict, tuple, set, frozenset, torch.dtype)


def _path(raw: bytes) -> Path:
    """Where the config of these config.json bytes is kept under this transformers release."""
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(b"%d\0%s\0" % (FORMAT, version.encode()) + raw).hexdigest()[:32]
    return cache_root() / "configs" / f"{key}.json"


# JSON has no tuples, sets, int keys (id2label; the pipeline plans are tuples) or torch dtypes (a config's
# dtype once read): kept tagged, one key each
_TAGS = ("__tuple__", "__set__", "__int_keys__", "__dtype__")


def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if value and all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {"__int_keys__": [[k, _encode(v)] for k, v in value.items()]}
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and next(iter(value)) in _TAGS:
        tag, items = next(iter(value.items()))
        if tag == "__int_keys__":
            return {k: _decode(v) for k, v in items}
        if tag == "__dtype__":
            return getattr(torch, items)
        return (tuple if tag == "__tuple__" else set)(_decode(v) for v in items)
    return {k: _decode(v) for k, v in value.items()}


def _rebuild(kept: dict) -> Any:
    return _from_parts(kept["class"], _decode(kept["class_attributes"]), _decode(kept["attributes"]))


def _from_parts(name: str, class_attributes: dict, attributes: dict) -> Any:
    """An instance of a PretrainedConfig subclass named `name` with these class and instance attributes. It pickles
    as these parts (a tensor-parallel rank is sent the config), as the class exists only where it was made."""
    from transformers import PretrainedConfig

    cls = type(name, (PretrainedConfig,), {**class_attributes, "__module__": __name__, "__reduce__": _reduce,
                                           "__class_attributes__": class_attributes})
    config = cls.__new__(cls)
    config.__dict__.update(attributes)
    return config


def _reduce(config: Any) -> tuple:
    return _from_parts, (type(config).__name__, type(config).__class_attributes__, dict(vars(config)))


def load(raw: bytes) -> Any | None:
    """The config kept for these config.json bytes, or None (never kept, or unreadable: loaded as usual)."""
    try:
        return _rebuild(json.loads(_path(raw).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _readings(config: Any) -> dict[str, Any]:
    """Every data attribute the config answers (instance, class and property), by name; methods and objects
    computed by PretrainedConfig's own code from these (views, helpers) are left to that code."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # deprecated aliases (torch_dtype, use_return_dict) warn when read
    try:
        out = {}
        for name in sorted(set(dir(config)) | set(vars(config))):
            if name.startswith("__"):
                continue
            try:
                value = getattr(config, name)
            except Exception as exc:  # a property that raises must raise alike
                out[name] = ("raises", type(exc).__name__)
                continue
            if not callable(value) and isinstance(value, _PLAIN):
                out[name] = value
        return out
    finally:
        hf_logging.set_verbosity(verbosity)


def keep(raw: bytes, config: Any) -> bool:
    """Keep transformers' `config` of these config.json bytes if it can be rebuilt faithfully; True if kept."""
    from transformers import PretrainedConfig

    cls = type(config)
    if cls is PretrainedConfig or not issubclass(cls, PretrainedConfig):
        return False  # a model_type transformers does not know: built without a config class, nothing to save
    base = dict(vars(PretrainedConfig))
    class_attributes = {}
    for klass in reversed(cls.__mro__[:cls.__mro__.index(PretrainedConfig)]):
        for name, value in vars(klass).items():
            if name.startswith("__") or callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                continue
            if name in base and base[name] == value:
                continue
            class_attributes[name] = value
    kept = {"class": cls.__name__, "class_attributes": _encode(class_attributes), "attributes": _encode(vars(config))}
    try:
        text = json.dumps(kept, sort_keys=True)
        rebuilt = _rebuild(json.loads(text))
        faithful = rebuilt.to_dict() == config.to_dict() and _readings(rebuilt) == _readings(config)
    except (TypeError, ValueError):  # an attribute JSON cannot hold (a set, an object)
        return False
    if not faithful:
        return False
    path = _path(raw)
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start its half second
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return True
    return False
