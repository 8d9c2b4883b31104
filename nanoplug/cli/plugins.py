"""`nanoplug plugins`: every plugin of every kind, where it comes from, and whether it can serve.

Availability is judged against a default target (device auto, its dtype, no model) unless --model,
--device or --dtype say otherwise, so a new user sees at a glance what "auto" would pick and why not
the others. Broken third-party plugins are listed with their error, and one plugin that misbehaves
while it is listed is shown as unavailable with the reason: the listing itself always prints.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from nanoplug.api.hookspecs import KIND_HOOKS

if TYPE_CHECKING:
    from nanoplug.engine.registry import Registry


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list every plugin of every kind: available or why not")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.add_argument("--model", metavar="DIR", help="judge availability against this checkpoint folder")
    p.add_argument("--device", default="auto", help="judge against this device (auto, cpu, cuda, cuda:N)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="judge against this dtype")
    p.set_defaults(func=run)


def build_target(model: str | None, device: str, dtype: str, registry: Registry):
    """The Target availability is judged against: the engine's own device, platform and dtype rules."""
    from nanoplug.api import ModelFacts, Target
    from nanoplug.config import EngineConfig
    from nanoplug.engine.startup import platform_and_dtype

    config = EngineConfig(model=model or "", device=device, dtype=dtype)
    hf_config, facts = None, None
    if model:
        from nanoplug.checkpoint.loader import load_hf_config

        hf_config = load_hf_config(config.model)
        facts = ModelFacts.from_hf_config(hf_config)
    _, torch_device, torch_dtype = platform_and_dtype(registry, config, hf_config)
    return Target(device=torch_device, dtype=torch_dtype, model=facts, block_size=config.kv_block_size,
                  tensor_parallel_size=config.tensor_parallel_size)


def listing(registry: Registry, target, model: str | None = None) -> dict[str, Any]:
    """The whole report as plain data: the --json output and the source of the table."""
    kinds: dict[str, Any] = {}
    for kind in KIND_HOOKS:
        plugins = [_describe(registry, kind, name, target) for name in registry.by_priority(kind)]
        if kind == "model":  # the engine picks the model plugin by the checkpoint's architecture
            arch = target.model.architecture if target.model else None
            auto = next((p["name"] for p in plugins if p["available"] and p["name"] == arch), None)
        elif kind in ("adapter", "speculator"):  # listed by the user (a speculator: by name), never picked by "auto"
            auto = None
        elif kind == "weight_format":  # by the checkpoint's format: plain weights without --model
            auto = _auto_weight_format(registry, target, model)
        else:
            auto = next((p["name"] for p in plugins if p["available"]), None)
        kinds[kind] = {"auto": auto, "plugins": plugins}
    return {
        "target": {
            "device": str(target.device),
            "dtype": str(target.dtype).removeprefix("torch."),
            "model": model or None,
            "architecture": target.model.architecture if target.model else None,
        },
        "kinds": kinds,
        "broken": [{"name": b.name, "source": b.source, "error": b.error} for b in registry.broken],
    }


def _auto_weight_format(registry: Registry, target, model: str | None) -> str | None:
    """What quantization="auto" would keep the weights of `model` (plain without one) in, or None."""
    from nanoplug.engine.startup import auto_weight_format, quant_method

    try:
        method = None
        if model:
            from nanoplug.checkpoint.loader import load_hf_config

            method = quant_method(model, load_hf_config(model))
        return auto_weight_format(registry, method, target).name
    except Exception:  # nothing can serve, or a format misbehaves: the rows say why
        return None


def _describe(registry: Registry, kind: str, name: str, target) -> dict[str, Any]:
    """One plugin's row; the registry checked its attributes at registration, and anything that still
    raises here becomes its reason rather than ending the listing."""
    entry = registry.entries[kind][name]
    row = {"name": name, "source": entry.source, "available": False, "reasons": [], "description": "", "priority": None,
           "notes": []}
    try:
        reasons = [str(r) for r in registry.reasons(kind, name, target)]
        cls = entry.cls
        description = getattr(cls, "description", "") if cls is not None else ""
        priority = getattr(cls, "priority", None) if cls is not None else None
        notes = [str(n) for n in cls.notes(target)] if cls is not None and hasattr(cls, "notes") else []
    except Exception as exc:
        row["reasons"] = [f"listing it raised {type(exc).__name__}: {exc}"]
        return row
    row.update(available=not reasons, reasons=reasons, description=str(description), notes=notes,
               priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else None)
    return row


def format_table(data: dict[str, Any]) -> str:
    t = data["target"]
    lines = [f"judged for device {t['device']}, dtype {t['dtype']}, model {t['model'] or '(none)'}"]
    for kind, info in data["kinds"].items():
        header = f"\n{kind}" + (f"  (auto picks {info['auto']})" if info["auto"] else "")
        lines.append(header)
        width = max((len(p["name"]) for p in info["plugins"]), default=0)
        for p in info["plugins"]:
            status = "available  " if p["available"] else "unavailable"
            lines.append(f"  {p['name']:<{width}}  {status}  [{p['source']}]  {p['description']}".rstrip())
            lines += [f"  {'':<{width}}    - {r}" for r in p["reasons"]]
            lines += [f"  {'':<{width}}    * {n}" for n in p.get("notes", [])]
    if data["broken"]:
        lines.append("\nbroken plugins (failed to load)")
        lines += [f"  {b['name']}  [{b['source']}]  {b['error']}" for b in data["broken"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    try:
        from nanoplug.engine.registry import Registry

        registry = Registry()
        target = build_target(args.model, args.device, args.dtype, registry)
    except (ValidationError, RuntimeError) as exc:  # a bad --device/--dtype, or cuda asked on a CPU machine
        print(f"nanoplug plugins: error: {exc}", file=sys.stderr)
        return 2
    data = listing(registry, target, args.model)
    print(json.dumps(data, indent=2, default=str) if args.json else format_table(data))
    return 0
