"""Reads a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) into per-module A/B pairs.

Everything PEFT would do differently from a plain `W + scaling * B @ A` (DoRA, extra trained
modules, LoRA biases, ...) is refused here with the fix, so what is returned merges exactly like
PEFT's `merge_and_unload()`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from nanoplug.api import AdapterError, ModelLoadError
from nanoplug.api.files import read_json

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MERGE_FIX = "merge it into the base model with PEFT (model.merge_and_unload().save_pretrained(DIR)) and serve DIR"
RESAVE_FIX = "save the adapter again with PEFT's save_pretrained(DIR)"

# LoraConfig options that change the maths beyond W + scaling * B @ A: refused when set.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora=True)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "lora_bias": "LoRA biases (lora_bias=True)",
    "fan_in_fan_out": "Conv1D-layout weights (fan_in_fan_out=True), which no nanoplug model uses",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora=True)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
}
KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear layer: its update is `scaling * B @ A` ([out, in]), in float32."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    alpha: float
    rslora: bool  # scaling alpha / sqrt(r) instead of alpha / r

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def shape(self) -> list[int]:
        return [self.b.shape[0], self.a.shape[1]]

    def scaling(self, scale: float = 1.0) -> float:
        """PEFT's `set_scale` arithmetic, operation for operation, so merges agree to the last bit."""
        return scale * self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def delta(self, scale: float = 1.0) -> torch.Tensor:
        """The weight update, computed in the same order as PEFT's `get_delta_weight`."""
        return (self.b @ self.a) * self.scaling(scale)


@dataclass(frozen=True)
class PeftLora:
    """A PEFT LoRA folder: its config and its modules, keyed by the base model's module name."""

    path: Path
    config: dict[str, Any]
    modules: dict[str, LoraModule]

    @property
    def base_model(self) -> str | None:
        return self.config.get("base_model_name_or_path") or None


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first pattern that matches the end of the module's name wins."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def read_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise ModelLoadError(
            f"{str(file)!r} is missing; pass the folder PEFT's save_pretrained wrote (it holds {CONFIG_FILE} "
            f"and {WEIGHTS_FILE})"
        )
    config = read_json(file, RESAVE_FIX)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{str(file)!r} holds a JSON {type(config).__name__}, not an object of settings; {RESAVE_FIX}")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(
            f"adapter {str(folder)!r} is a {peft_type} adapter, but the lora plugin applies LoRA adapters only; {MERGE_FIX}"
        )
    for option, what in UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise AdapterError(f"adapter {str(folder)!r} uses {what}, which the lora plugin does not apply; {MERGE_FIX}")
    return config


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        hint = ("the folder holds the legacy adapter_model.bin: re-save the adapter with "
                "save_pretrained(DIR, safe_serialization=True)") if (folder / "adapter_model.bin").is_file() \
            else "pass the folder PEFT's save_pretrained wrote"
        raise ModelLoadError(f"{str(file)!r} is missing; {hint}")
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{str(file)!r} is not a readable safetensors file ({exc}); the file is damaged or "
                             f"incomplete: {RESAVE_FIX}") from exc


def read_peft_lora(path: str | Path) -> PeftLora:
    """Read and check a PEFT LoRA folder; every module's A/B pair and scaling, in float32."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"adapter folder {str(folder)!r} does not exist; pass the folder PEFT's save_pretrained wrote "
            f"({CONFIG_FILE}, {WEIGHTS_FILE})"
        )
    config = read_config(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in read_weights(folder).items():
        match = KEY.match(key)
        if match is None:
            raise AdapterError(
                f"adapter {str(folder)!r} holds tensor {key!r}, which is not a LoRA A/B matrix of a linear layer "
                f"(LoRA on embeddings and trained extra modules are not supported); {MERGE_FIX}"
            )
        pairs.setdefault(match["module"], {})[match["which"]] = tensor.float()
    if not pairs:
        raise AdapterError(f"adapter {str(folder)!r} holds no LoRA weights; save the adapter again with PEFT")
    modules = {}
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(f"adapter {str(folder)!r} lacks lora_{missing} of {name!r}; the file is incomplete, "
                               "save the adapter again")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {str(folder)!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} of "
                               f"{name!r} do not chain (B @ A); the file is damaged, save the adapter again")
        alpha = _pattern_value(config.get("alpha_pattern"), name, config.get("lora_alpha", 8))
        modules[name] = LoraModule(a, b, alpha, bool(config.get("use_rslora")))
    return PeftLora(folder, config, modules)
