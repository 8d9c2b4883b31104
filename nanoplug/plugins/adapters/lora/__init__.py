"""Adapter `lora`: PEFT LoRA folders, merged into the weights as they load, or served per request.

Merging happens on the full checkpoint tensor, before the loader packs q/k/v and gate/up and before
tensor-parallel sharding, so every shard gets its slice of `W + scale * alpha/r * B @ A` for free.
With `merge=False` the adapter only checks each tensor's shape here; `serve_per_request` then adds
its low-rank update at run time to the tokens of the requests that ask for it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanoplug.api import AdapterError, ModelFacts, ProcessGroup, WeightAdapter
from nanoplug.api.files import read_json
from nanoplug.plugins.adapters.lora.peft_folder import PeftLora, read_peft_lora

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


class LoraAdapter(WeightAdapter):
    description = "PEFT LoRA folders: merged at load (default) or picked per request (merge=False)"

    def __init__(self, spec, facts: ModelFacts, base_config: Any):
        super().__init__(spec, facts, base_config)
        self.lora: PeftLora = read_peft_lora(spec.path)
        check_base_model(self.lora, facts, base_config)
        self.pending = set(self.lora.modules)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        module = self.lora.modules.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if module is None:
            return tensor
        if module.shape != list(tensor.shape):
            raise AdapterError(
                f"adapter {str(self.lora.path)!r} does not fit this model: {name} is {list(tensor.shape)} here, but "
                f"the adapter's update for it is {module.shape}; {self._trained_for()}"
            )
        self.pending.discard(name.removesuffix(".weight"))
        if not self.spec.merge:
            return tensor
        return tensor.float() + module.delta(self.spec.scale)  # float32: stacked adapters round once, at the copy

    def finish(self) -> None:
        if self.pending:
            missing = sorted(self.pending)
            raise AdapterError(
                f"adapter {str(self.lora.path)!r} targets {len(missing)} module(s) this model's checkpoint lacks, "
                f"e.g. {', '.join(missing[:3])}; {self._trained_for()} (an lm_head tied to the embeddings has no "
                "weight of its own to adapt)"
            )

    def _trained_for(self) -> str:
        base = self.lora.base_model
        return (f"load it with the base model it was trained on ({base!r})" if base
                else "load it with the base model it was trained on")

    @classmethod
    def serve_per_request(cls, model: torch.nn.Module, adapters: list[WeightAdapter], group: ProcessGroup,
                          max_tokens: int, slots: int = 0, rank: int = 0):
        from nanoplug.plugins.adapters.lora.per_request import attach_multi_lora  # noqa: PLC0415

        others = [type(a).__name__ for a in adapters if not isinstance(a, LoraAdapter)]
        if others:
            raise AdapterError(f"per-request adapters must all be of kind 'lora' (got {', '.join(others)}); "
                               "merge the others (merge=True)")
        return attach_multi_lora(model, [(a.lora, a.spec.scale) for a in adapters], max_tokens, slots, rank)


def check_base_model(lora: PeftLora, facts: ModelFacts, base_config: Any) -> None:
    """Refuse an adapter recorded as trained for another architecture, or for a base of other shapes."""
    recorded = (lora.config.get("auto_mapping") or {}).get("base_model_class")
    if recorded and recorded != facts.architecture:
        raise AdapterError(
            f"adapter {str(lora.path)!r} was trained for a {recorded}, but this model is a {facts.architecture}; "
            f"load it with its own base model ({lora.base_model or recorded!r})"
        )
    base = Path(lora.base_model).expanduser() if lora.base_model else None
    if base is None or not (base / "config.json").is_file():
        return  # a Hub id, or a folder not on this machine: the shapes are checked tensor by tensor
    saved = read_json(base / "config.json", "the adapter names this folder as its base model "
                      "(base_model_name_or_path): fix its config.json")
    if not isinstance(saved, dict):
        return  # not a config: the shapes are checked tensor by tensor
    archs = saved.get("architectures") or []
    differ = [f"architecture {archs[0]} vs {facts.architecture}"] if archs and archs[0] != facts.architecture else []
    differ += [f"{key} {saved[key]} vs {getattr(base_config, key)}" for key in SHAPE_KEYS
               if key in saved and getattr(base_config, key, saved[key]) != saved[key]]
    if differ:
        raise AdapterError(
            f"adapter {str(lora.path)!r} was trained for {str(base)!r}, which differs from this model "
            f"({'; '.join(differ)}); load the adapter with the base model it was trained on"
        )

