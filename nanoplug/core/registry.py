"""Finds plugins (built-ins from registry.toml, third parties from the `nanoplug` entry-point group),
asks each whether it can serve, and resolves one name per kind for one engine.

Start-up only: the engine keeps the resolved classes; nothing here runs per step.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from nanoplug.core import hookspecs
from nanoplug.core.errors import PluginLoadError, PluginUnavailableError, UnknownPluginError
from nanoplug.core.interfaces import PLUGIN_API_VERSION, Target

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("nanoplug")

KIND_HOOKS = {
    "attention": "nanoplug_register_attention",
    "kv_cache": "nanoplug_register_kv_cache",
    "model": "nanoplug_register_model",
    "parallel": "nanoplug_register_parallel",
    "adapter": "nanoplug_register_adapter",
}
ENTRY_POINT_GROUP = "nanoplug"
DISABLE_ENTRY_POINTS_ENV = "NANOPLUG_DISABLE_ENTRY_POINTS"
BUILTIN_TOML = Path(__file__).resolve().parent.parent / "registry.toml"


@dataclass
class PluginEntry:
    """One named plugin of one kind: where it comes from and, once loaded, its class."""

    kind: str
    name: str
    source: str
    target: str | None = None  # "module:object" for built-ins not yet imported
    cls: Any = None
    error: str | None = None


@dataclass
class BrokenPlugin:
    """A third-party plugin that could not be loaded: reported, never swallowed."""

    name: str
    source: str
    error: str


class Registrar:
    """What a hook implementation receives: `register.add(name, cls)`."""

    def __init__(self, registry: "Registry", kind: str, source: str):
        self._registry, self._kind, self._source = registry, kind, source

    def add(self, name: str, cls: Any) -> None:
        entries = self._registry.entries[self._kind]
        old = entries.get(name)
        if old is not None and old.cls is not None and old.cls is not cls and old.source != self._source:
            log.warning("%s plugin %r from %s replaces the one from %s", self._kind, name, self._source, old.source)
        if old is not None and old.source == self._source and old.target is not None:
            old.cls = cls
            return
        entries[name] = PluginEntry(self._kind, name, self._source, cls=cls)


@dataclass
class Resolution:
    """The outcome of resolving one kind: what was asked, what was chosen, and why."""

    kind: str
    asked: str
    name: str
    cls: Any
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def describe(self) -> str:
        why = "; ".join(f"{n}: {', '.join(r)}" for n, r in self.skipped.items())
        return f"{self.kind}: asked {self.asked!r}, chose {self.name!r}" + (f" (skipped {why})" if why else "")


def entry_points_enabled() -> bool:
    return os.environ.get(DISABLE_ENTRY_POINTS_ENV, "").lower() not in ("1", "true", "yes")


class Registry:
    """All plugins this process can see. Cheap to build: built-ins stay unimported until needed."""

    def __init__(self, load_entry_points: bool | None = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in KIND_HOOKS}
        self.broken: list[BrokenPlugin] = []
        with open(BUILTIN_TOML, "rb") as f:
            for kind, table in tomllib.load(f).items():
                for name, target in table.items():
                    self.entries[kind][name] = PluginEntry(kind, name, "built-in", target=target)
        if load_entry_points if load_entry_points is not None else entry_points_enabled():
            self._load_entry_points()

    # ----------------------------------------------------------------------------- discovery
    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            source = f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"
            try:
                self._collect(ep.load(), source)
            except Exception as exc:  # a broken third-party plugin is reported, not fatal
                self.broken.append(BrokenPlugin(ep.name, source, f"{type(exc).__name__}: {exc}"))
                log.warning("plugin %r from %s failed to load: %s: %s", ep.name, source, type(exc).__name__, exc)

    def _collect(self, module: Any, source: str) -> None:
        """Check the module's API version, register it with pluggy and run its registrar hooks."""
        version = getattr(module, "NANOPLUG_API_VERSION", None)
        if version != PLUGIN_API_VERSION:
            raise PluginLoadError(
                f"plugin module {getattr(module, '__name__', module)!r} ({source}) declares "
                f"NANOPLUG_API_VERSION = {version!r}, but this nanoplug speaks plugin API "
                f"{PLUGIN_API_VERSION}; install a release of the plugin built for API {PLUGIN_API_VERSION}"
            )
        if not self.pm.is_registered(module):
            self.pm.register(module)
        others = [p for p in self.pm.get_plugins() if p is not module]
        for kind, hook in KIND_HOOKS.items():
            self.pm.subset_hook_caller(hook, remove_plugins=others)(register=Registrar(self, kind, source))

    # ------------------------------------------------------------------------------- lookups
    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def get(self, kind: str, name: str) -> Any:
        """The plugin class for `name`, imported now if it is a built-in."""
        entry = self.entries[kind].get(name)
        if entry is None:
            broken = [b for b in self.broken if b.name == name]
            if broken:
                b = broken[0]
                raise PluginLoadError(f"{kind} plugin {name!r} from {b.source} failed to load: {b.error}")
            valid = ", ".join(self.names(kind)) or "none"
            hint = f"; plugins that failed to load: {', '.join(b.name for b in self.broken)}" if self.broken else ""
            raise UnknownPluginError(f"unknown {kind} plugin {name!r}; valid names: {valid}{hint}")
        if entry.cls is None:
            self._import_builtin(entry)
        return entry.cls

    def _import_builtin(self, entry: PluginEntry) -> None:
        module_name, _, obj = entry.target.partition(":")
        try:
            module = importlib.import_module(module_name)
            self._collect(module, entry.source)
            if entry.cls is None:
                entry.cls = getattr(module, obj)
        except Exception as exc:
            entry.error = f"{type(exc).__name__}: {exc}"
            raise PluginLoadError(f"{entry.kind} plugin {entry.name!r} ({entry.target}) failed to import: {entry.error}") from exc

    def reasons(self, kind: str, name: str, target: Target) -> list[str]:
        """What stops `name` from serving `target`; an import failure is a reason too."""
        try:
            cls = self.get(kind, name)
        except PluginLoadError as exc:
            return [str(exc)]
        try:
            return list(cls.unavailable(target))
        except Exception as exc:
            return [f"availability check raised {type(exc).__name__}: {exc}"]

    def resolve(self, kind: str, asked: str, target: Target) -> Resolution:
        """Pick the plugin of `kind` for this engine: the named one if it can serve, or the best for "auto"."""
        if asked != "auto":
            cls = self.get(kind, asked)
            reasons = self.reasons(kind, asked, target)
            if reasons:
                raise PluginUnavailableError(f"{kind} plugin {asked!r} cannot serve this config: " + "; ".join(reasons))
            return Resolution(kind, asked, asked, cls)
        skipped: dict[str, list[str]] = {}
        for name in self.by_priority(kind):
            reasons = self.reasons(kind, name, target)
            if not reasons:
                res = Resolution(kind, asked, name, self.get(kind, name), skipped)
                log.info(res.describe())
                return res
            skipped[name] = reasons
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in skipped.items())
        raise PluginUnavailableError(f"no {kind} plugin can serve this config: {detail}")

    def by_priority(self, kind: str) -> list[str]:
        """Names of `kind`, best first; a plugin that fails to import sorts last."""

        def key(name: str) -> tuple[int, str]:
            try:
                return (-int(getattr(self.get(kind, name), "priority", 0)), name)
            except PluginLoadError:
                return (1 << 30, name)

        return sorted(self.entries[kind], key=key)


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry (discovery only; each engine keeps its own choices)."""
    global _default
    if _default is None:
        _default = Registry()
    return _default
