"""Start-up decisions, made once per engine: the checkpoint's config and facts, the device, the
platform, the dtype, and one plugin of each kind (the only time the registry is consulted); and the
wiring that follows them (`start`): the tokenizer, the EOS ids, the worker and its KV cache.

Each decision is logged as asked, chosen and why (`Choices.describe`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nanoplug.api import ModelFacts, Target
from nanoplug.api.step import kv_groups
from nanoplug.api.errors import ModelLoadError, PluginUnavailableError
from nanoplug.config import EngineConfig
from nanoplug.checkpoint.loader import checkpoint_dir, load_hf_config
from nanoplug.checkpoint.source import resolve_model_path
from nanoplug.engine.context_length import checked_max_model_len
from nanoplug.engine.platform_options import validate_platform_options
from nanoplug.engine.registry import Registry, Resolution
from nanoplug.engine.tokenizer import load_tokenizer
from nanoplug.worker.runner import PluginClasses, RunnerFactory, WorkerSpec

log = logging.getLogger("nanoplug")
KINDS_SHOWN = ("model", "attention", "prefill_attention", "kv_cache", "parallel", "platform", "weight_format")
WEIGHT_FORMAT = "weight_format"


@dataclass(frozen=True)
class Checkpoint:
    """The checkpoint's Hugging Face config and the facts plugins judge it by, read once."""

    path: str
    hf_config: Any
    facts: ModelFacts

    @property
    def quant_method(self) -> str | None:
        return quant_method(self.path, self.hf_config)

    @classmethod
    def load(cls, path: str, registry: Registry) -> "Checkpoint":
        hf_config = load_hf_config(path)
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        if arch not in registry.entries["model"]:  # before reading fields an unknown config may not have
            raise ModelLoadError(
                f"architecture {arch!r} of {path!r} is not supported; supported architectures: "
                + ", ".join(registry.names("model"))
            )
        return cls(path, hf_config, ModelFacts.from_hf_config(hf_config))


def quant_method(path: str, hf_config: Any) -> str | None:
    """The format the checkpoint's weights are stored in: its config's quantization_config.quant_method,
    or "gguf" for a folder whose weights are a GGUF file; None for plain weights."""
    qconfig = getattr(hf_config, "quantization_config", None) or {}
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else getattr(qconfig, "quant_method", None)
    if method is None:
        from pathlib import Path

        from nanoplug.checkpoint.gguf_file import QUANT_METHOD, gguf_in

        method = QUANT_METHOD if Path(path).is_dir() and gguf_in(Path(path)) else None
    return method


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA GPU; use device='cpu'")
    return device


def saved_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype the checkpoint was saved in, if it says."""
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    saved = getattr(torch, saved, None) if isinstance(saved, str) else saved
    return saved if isinstance(saved, torch.dtype) else None


@dataclass
class Choices:
    """One engine's plugins, by kind: each a Resolution (asked, chosen, why)."""

    by_kind: dict[str, Resolution]
    adapters: list[Resolution] = field(default_factory=list)

    def __getitem__(self, kind: str) -> Any:
        return self.adapters if kind == "adapters" else self.by_kind[kind]

    def describe(self) -> list[str]:
        """One line per kind: what was asked, what was chosen, and why."""
        lines = []
        for key in KINDS_SHOWN:
            res = self.by_kind[key]
            lines.append(res.describe().replace(res.kind, key, 1))
        return lines + [r.describe() for r in self.adapters]


def platform_and_dtype(registry: Registry, config: EngineConfig, hf_config: Any = None) -> tuple[Resolution, torch.device, torch.dtype]:
    """The device, the platform that serves it, and the dtype (the platform's default for "auto")."""
    device = resolve_device(config.device)
    asked_dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    # a platform is judged by its device; the dtype it would default to is not known yet
    platform = registry.resolve("platform", config.platform,
                                Target(device=device, dtype=asked_dtype or torch.float32,
                                       block_size=config.kv_block_size,
                                       tensor_parallel_size=config.tensor_parallel_size))
    dtype = asked_dtype or platform.cls.default_dtype(saved_dtype(hf_config) if hf_config is not None else None)
    return platform, device, dtype


def _formats(registry: Registry, keep: Any) -> list[str]:
    """Weight formats, best first, whose class `keep(cls)` accepts (one that fails to import is left out)."""
    names = []
    for name in registry.by_priority(WEIGHT_FORMAT):
        try:
            cls = registry.get(WEIGHT_FORMAT, name)
        except Exception:
            continue
        if keep(cls):
            names.append(name)
    return names


def auto_weight_format(registry: Registry, method: str | None, target: Target,
                       merged: bool = False) -> Resolution:
    """quantization="auto": the best format that keeps the checkpoint's `method` and can serve, else the best
    that takes plain weights (a quantized checkpoint then dequantized); formats that quantize are never picked.
    `merged`: a merged adapter changes the weights, which needs them dequantized."""
    skipped: dict[str, list[str]] = {}
    if method is not None:
        keeping = _formats(registry, lambda c: c.quant_method == method and not c.quantizes)
        for name in keeping:
            reasons = registry.reasons(WEIGHT_FORMAT, name, target)
            if merged:
                reasons.append("a merged adapter changes the weights, which needs them dequantized")
            if not reasons:
                res = Resolution(WEIGHT_FORMAT, "auto", name, registry.get(WEIGHT_FORMAT, name))
                log.info(res.describe())
                return res
            skipped[name] = reasons
        if not keeping:
            skipped[method] = [f"no weight_format plugin keeps {method!r} weights"]
        from nanoplug.checkpoint.gguf_file import QUANT_METHOD as GGUF

        if method != GGUF:  # the loader dequantizes GGUF tensors only: nothing else serves these weights
            served = sorted({registry.get(WEIGHT_FORMAT, n).quant_method
                             for n in _formats(registry, lambda c: c.quant_method is not None)})
            why = "; ".join(f"{n}: {', '.join(r)}" for n, r in skipped.items())
            raise PluginUnavailableError(
                f"the checkpoint's weights are stored as {method!r} (quantization_config.quant_method), which no "
                f"weight_format plugin here can serve ({why}); nanoplug keeps {', '.join(served)} checkpoints: "
                "use one of those, or the unquantized checkpoint")
    res = registry.resolve(WEIGHT_FORMAT, "auto", target,
                           among=_formats(registry, lambda c: c.quant_method is None and not c.quantizes))
    res.skipped = {**skipped, **res.skipped}
    return res


def resolve_weight_format(registry: Registry, config: EngineConfig, checkpoint: Checkpoint,
                          target: Target) -> Resolution:
    """The weight format: by `quantization` ("auto"; a name insists, an error says why it cannot serve;
    None: `dense`, every weight dequantized to the dtype) and the checkpoint's format."""
    method = checkpoint.quant_method
    merged = any(spec.merge for spec in config.adapters)
    if config.quantization == "auto":
        res = auto_weight_format(registry, method, target, merged)
        if method is not None and res.cls.quant_method != method:
            log.info("weights of %s: dequantized to %s, not kept as %s (%s)", checkpoint.path,
                     str(target.dtype).removeprefix("torch."), method,
                     "; ".join(f"{n}: {', '.join(r)}" for n, r in res.skipped.items()))
        return res
    res = registry.resolve(WEIGHT_FORMAT, "dense" if config.quantization is None else config.quantization, target)
    keeps = res.cls.quant_method
    if keeps is not None and keeps != method:
        raise PluginUnavailableError(
            f"weight_format plugin {res.name!r} keeps {keeps!r} checkpoints' weights, but {checkpoint.path} holds "
            f"{repr(method) if method else 'plain'} weights; use quantization='auto'")
    if keeps is not None and merged:
        raise PluginUnavailableError(
            f"weight_format plugin {res.name!r} keeps the weights as stored, but a merged adapter changes them; "
            "use quantization=None (dequantized) or serve the adapter per request (merge=False)")
    return res


def resolve_plugins(registry: Registry, config: EngineConfig, checkpoint: Checkpoint) -> tuple[Choices, Target]:
    """Pick the plugin of each kind for this engine, and the Target they were judged against."""
    platform, device, dtype = platform_and_dtype(registry, config, checkpoint.hf_config)
    rows = 1 + config.num_speculative_tokens if config.speculator is not None else 1
    target = Target(device=device, dtype=dtype, model=checkpoint.facts, block_size=config.kv_block_size,
                    tensor_parallel_size=config.tensor_parallel_size, decode_query_len=rows)
    kv_cache = registry.resolve("kv_cache", config.kv_cache, target)
    cache_dtype = kv_cache.cls().cache_dtype(dtype)
    if cache_dtype != dtype:  # backends judge whether they can read a cache of another dtype
        target = replace(target, kv_cache_dtype=cache_dtype)
    by_kind = {
        "platform": platform,
        "kv_cache": kv_cache,
        "model": registry.resolve("model", checkpoint.facts.architecture, target),
        "attention": registry.resolve("attention", config.attention, target),
        "parallel": registry.resolve("parallel", config.parallel, target),
    }
    by_kind["prefill_attention"] = (registry.resolve("attention", config.prefill_attention, target)
                                    if config.prefill_attention else by_kind["attention"])
    by_kind[WEIGHT_FORMAT] = resolve_weight_format(registry, config, checkpoint, target)
    adapters = [registry.resolve("adapter", spec.kind, target) for spec in config.adapters]
    return Choices(by_kind, adapters), target


@dataclass
class Started:
    """What `start` made: the engine's settled config, its plugins, tokenizer and running worker."""

    config: EngineConfig
    checkpoint: Checkpoint
    choices: Choices
    target: Target
    tokenizer: Any  # None with skip_tokenizer_init
    eos_token_ids: set[int]
    request_adapter_ids: dict[str, int]  # per-request adapters (merge=False) by name: 1..K in config order, 0 = none
    worker: Any  # the parallel strategy's worker
    num_kv_blocks: int
    overlap: bool  # whether steps are overlapped


def start(config: EngineConfig, registry: Registry) -> Started:
    """Settle the config against the checkpoint, resolve the plugins and start the worker.

    config.model: a checkpoint folder, or a Hugging Face id (fetched where the network allows)."""
    config = config.model_copy(update={"model": resolve_model_path(config.model)})
    options = validate_platform_options(registry, config)  # before any file is read
    checkpoint = Checkpoint.load(config.model, registry)  # config.json read once, here
    config.max_model_len = checked_max_model_len(config.max_model_len, "max_model_len" in config.model_fields_set,
                                                 checkpoint.hf_config, str(checkpoint_dir(config.model) / "config.json"))
    adapter_ids = {spec.label: i for i, spec in enumerate((s for s in config.adapters if not s.merge), 1)}
    choices, target = resolve_plugins(registry, config, checkpoint)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(checkpoint_dir(config.model), checkpoint.hf_config)
    plugins = PluginClasses(
        model=choices["model"].cls,
        prefill_attention=choices["prefill_attention"].cls,
        decode_attention=choices["attention"].cls,
        kv_cache=choices["kv_cache"].cls,
        adapters=[(r.cls, spec) for r, spec in zip(choices["adapters"], config.adapters)],
        request_adapter=registry.resolve("adapter", "lora", target).cls if config.max_loras > len(adapter_ids) else None,
        weight_format=choices["weight_format"].cls,
        platform=choices["platform"].cls,
        platform_name=choices["platform"].name,
        platform_options=options.get(choices["platform"].name) or choices["platform"].cls.Options(),  # defaults when none given
    )
    strategy = choices["parallel"].cls(target)
    # a speculator that keeps K/V of its own in the target's geometry (an EAGLE head) is sized for with the cache
    extra_kv = getattr(registry.get("speculator", config.speculator), "kv_layers", 0) if config.speculator else 0
    worker = strategy.start(RunnerFactory(WorkerSpec(config, plugins, checkpoint.hf_config, checkpoint.facts, target,
                                                     extra_kv_layers=extra_kv)))
    num_blocks = worker.num_kv_blocks()
    facts = checkpoint.facts  # a sequence takes its blocks in every KV group (api/step.py KVGroups)
    groups = len(kv_groups(facts.sliding_windows, facts.num_layers).windows)
    if num_blocks // groups * config.kv_block_size < config.max_model_len:
        worker.shutdown()
        raise RuntimeError(
            f"the KV cache holds {num_blocks // groups * config.kv_block_size} tokens, fewer than max_model_len "
            f"({config.max_model_len}); lower max_model_len or give the cache more memory"
        )
    return Started(config, checkpoint, choices, target, tokenizer, eos_ids(config.model, checkpoint.hf_config, tokenizer),
                   adapter_ids, worker, num_blocks, wants_overlap(config, choices))


def wants_overlap(config: EngineConfig, choices: Choices) -> bool:
    """Overlapped steps: asked for, or the platform's default (on for CUDA: on a CPU the host computes the step itself)."""
    asked = config.overlap_steps
    if not choices["parallel"].cls.supports_overlap:
        if asked:
            log.warning("parallel strategy %r cannot overlap steps; they run one after another", choices["parallel"].name)
        return False
    return choices["platform"].cls.overlaps_by_default() if asked is None else asked


def eos_ids(model: str, hf_config: Any, tokenizer: Any) -> set[int]:
    """The token ids that end a sequence: the generation config's (else the model config's) and the tokenizer's."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except Exception:
        eos = getattr(hf_config, "eos_token_id", None)
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids
