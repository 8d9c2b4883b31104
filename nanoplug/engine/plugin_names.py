"""The plugin names known without loading anything heavy: the built-ins of registry.toml and whether a
third-party plugin package is installed (its names are known only once it loads). A command line checks
the names it was given with these before torch is imported, so a typo is refused at once; the registry
(registry.py) reads the same file and entry points when an engine starts.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENTRY_POINT_GROUP = "nanoplug"
DISABLE_ENTRY_POINTS_ENV = "NANOPLUG_DISABLE_ENTRY_POINTS"
BUILTIN_TOML = Path(__file__).resolve().parent.parent / "registry.toml"


def entry_points_enabled() -> bool:
    """False when NANOPLUG_DISABLE_ENTRY_POINTS is 1/true/yes: only built-ins are seen."""
    return os.environ.get(DISABLE_ENTRY_POINTS_ENV, "").strip().lower() not in ("1", "true", "yes")


@functools.lru_cache(maxsize=1)
def builtins() -> dict[str, dict[str, str]]:
    """kind -> name -> "module:object", as registry.toml declares them."""
    with open(BUILTIN_TOML, "rb") as f:
        return tomllib.load(f)


def unknown_name(kind: str, name: str) -> str | None:
    """The registry's refusal of `name` for `kind` when it is certainly unknown (no built-in of that name and
    no third-party plugin package installed), else None (known, "auto", or a plugin package may offer it)."""
    names = builtins().get(kind, {})
    if name == "auto" or name in names:
        return None
    if entry_points_enabled() and importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        return None  # a plugin package may register it: the registry decides when the engine starts
    return f"unknown {kind} plugin {name!r}; valid names: {', '.join(sorted(names)) or 'none'}, or 'auto'"
