"""Finds plugins (built-ins from registry.toml, third parties from the `nanoplug` entry-point group),
asks each whether it can serve, and resolves one name per kind for one engine.

Each built-in is declared once, in registry.toml ("module:object"), and imported only when chosen or
listed. Third-party plugins come through entry points: modules whose `@hookimpl` registrar hooks
(nanoplug/api/hookspecs.py) add what they offer. Both are checked the same way when they register.

Start-up only: the engine keeps the resolved classes; nothing here runs per step.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import pluggy
import torch

from nanoplug.api import (AttentionBackend, KVCacheStore, ModelArchitecture, ParallelStrategy, Platform, Target,
                          WeightAdapter, WeightFormat, hookspecs)
from nanoplug.api.errors import PluginLoadError, PluginUnavailableError, UnknownPluginError
from nanoplug.api.hookspecs import KIND_HOOKS, PLUGIN_API_VERSION
from nanoplug.api.speculator import Speculator
from nanoplug.api.structured import StructuredOutputBackend
from nanoplug.engine.plugin_names import (DISABLE_ENTRY_POINTS_ENV, ENTRY_POINT_GROUP,  # noqa: F401 (re-exported)
                                          builtins, entry_points_enabled)

log = logging.getLogger("nanoplug")

KIND_BASES = {
    "attention": AttentionBackend,
    "kv_cache": KVCacheStore,
    "model": ModelArchitecture,
    "parallel": ParallelStrategy,
    "adapter": WeightAdapter,
    "weight_format": WeightFormat,
    "platform": Platform,
    "structured_output": StructuredOutputBackend,
    "speculator": Speculator,
}
BUILTIN_SOURCE = "built-in"


@dataclass
class PluginEntry:
    """One named plugin of one kind: where it comes from and, once loaded, its class."""

    kind: str
    name: str
    source: str
    target: str | None = None  # "module:object" for built-ins not yet imported
    cls: Any = None
    error: str | None = None  # why its module failed to import (kept, so it is tried once)


@dataclass
class BrokenPlugin:
    """A third-party plugin that could not be loaded: reported, never swallowed."""

    name: str
    source: str
    error: str


def malformed(kind: str, cls: Any) -> list[str]:
    """What is wrong with `cls` as a plugin of `kind` (empty when nothing is): checked when it registers,
    so a bad declaration is reported against its plugin instead of failing later in every engine's "auto"."""
    base = KIND_BASES[kind]
    if not isinstance(cls, type):
        return [f"it is {cls!r}, not a class"]
    problems = []
    if not issubclass(cls, base):
        problems.append(f"{cls.__qualname__} is not a subclass of nanoplug.api.{base.__name__}")
    if kind == "model" and not issubclass(cls, torch.nn.Module):
        problems.append(f"{cls.__qualname__} is not a torch.nn.Module")
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract:
        problems.append(f"it does not implement {', '.join(abstract)}")
    try:
        priority, description = getattr(cls, "priority", 0), getattr(cls, "description", "")
        unavailable = inspect.getattr_static(cls, "unavailable", None)
        flags = {f: getattr(cls, f) for f in ("supports_cuda_graphs", "supports_overlap", "quantizes") if hasattr(cls, f)}
        packed = getattr(cls, "packed_modules_mapping", {}) if kind == "model" else {}
        kept, method = (cls.kept_types, cls.quant_method) if kind == "weight_format" else (frozenset(), None)
        gives_linear = kind == "adapter" and "linear_method" in dir(cls)
    except Exception as exc:  # a class attribute that raises when read
        return problems + [f"reading its attributes raised {type(exc).__name__}: {exc}"]
    if isinstance(priority, bool) or not isinstance(priority, int):
        problems.append(f"priority must be an int, found {priority!r}")
    if not isinstance(description, str):
        problems.append(f"description must be a str, found {description!r}")
    if not isinstance(unavailable, (classmethod, staticmethod)) or not callable(unavailable.__func__):
        problems.append(f"unavailable must be a classmethod unavailable(cls, target) -> list[str], "
                        f"found {unavailable!r}")
    problems += [f"{f} must be True or False, found {v!r}" for f, v in flags.items() if not isinstance(v, bool)]
    if not isinstance(packed, dict) or not all(isinstance(k, str) and isinstance(v, tuple) and len(v) == 2
                                               and isinstance(v[0], str) for k, v in packed.items()):
        problems.append("packed_modules_mapping must map checkpoint module names to (fused module, shard id), "
                        f"found {packed!r}")
    if not isinstance(kept, frozenset) or not all(isinstance(t, str) for t in kept):
        problems.append(f"kept_types must be a frozenset of GGUF type names, found {kept!r}")
    if method is not None and not isinstance(method, str):
        problems.append(f"quant_method must be a str or None, found {method!r}")
    if gives_linear:  # an adapter of the old contract that was a weight format
        problems.append("an adapter no longer gives a linear method: register a weight format as a "
                        "nanoplug.api.WeightFormat through nanoplug_register_weight_format")
    return problems


class Registrar:
    """What a hook implementation receives: `register.add(name, cls)`. Collects; the registry commits.

    A name another source already provides (a built-in, another plugin) is refused unless the plugin
    says `register.add(name, cls, replace=True)`: replacing a built-in is a decision, never an accident
    of which package was installed."""

    def __init__(self, kind: str):
        self.kind = kind
        self.added: list[tuple[str, Any, bool]] = []

    def add(self, name: str, cls: Any, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name or name == "auto" or any(c.isspace() or c == "," for c in name):
            raise PluginLoadError(f"{self.kind} plugin name {name!r} is invalid; use a non-empty name without spaces "
                                  "or commas, other than 'auto'")
        if not isinstance(replace, bool):
            raise PluginLoadError(f"{self.kind} plugin {name!r}: replace must be True or False, found {replace!r}")
        if any(n == name for n, _, _ in self.added):
            raise PluginLoadError(f"{self.kind} plugin {name!r} is registered twice by one module; "
                                  "register each name once")
        problems = malformed(self.kind, cls)
        if problems:
            base = KIND_BASES[self.kind].__name__
            raise PluginLoadError(
                f"{self.kind} plugin {name!r} is malformed: {'; '.join(problems)}; it must be a class that subclasses "
                f"nanoplug.api.{base} with a classmethod `unavailable(target)`, an int priority and a "
                "str description (see docs/plugins.md)"
            )
        self.added.append((name, cls, replace))


@dataclass
class Resolution:
    """The outcome of resolving one kind: what was asked, what was chosen, and why."""

    kind: str
    asked: str
    name: str
    cls: Any
    skipped: dict[str, list[str]] = field(default_factory=dict)
    caveats: list[str] = field(default_factory=list)  # why "auto" would have passed it over, had another served

    def describe(self) -> str:
        if self.asked != "auto":
            why = "asked by name"
        else:
            why = (f"the only one that can serve, although {', '.join(self.caveats)}" if self.caveats else
                   f"the highest priority ({getattr(self.cls, 'priority', 0)}) that can serve")
            if self.skipped:
                why += "; skipped " + "; ".join(f"{n}: {', '.join(r)}" for n, r in self.skipped.items())
        return f"{self.kind}: asked {self.asked!r}, chose {self.name!r} ({why})"


class Registry:
    """All plugins this process can see. Cheap to build: built-ins stay unimported until needed."""

    def __init__(self, load_entry_points: bool | None = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in KIND_HOOKS}
        self.broken: list[BrokenPlugin] = []
        for kind, table in builtins().items():
            for name, target in table.items():
                self.entries[kind][name] = PluginEntry(kind, name, BUILTIN_SOURCE, target=target)
        if load_entry_points if load_entry_points is not None else entry_points_enabled():
            self._load_entry_points()

    # ----------------------------------------------------------------------------- discovery
    def _load_entry_points(self) -> None:
        seen: set[tuple[str, str]] = set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (ep.name, ep.value) in seen:  # one distribution visible twice on sys.path
                continue
            seen.add((ep.name, ep.value))
            dist = getattr(ep, "dist", None)
            source = f"{dist.name} {dist.version}" if dist is not None else f"entry point {ep.value}"
            try:
                if not self.add_plugin_module(ep.load(), source):
                    raise PluginLoadError(
                        f"{ep.value} registers no plugin; implement a hook of nanoplug.api.hookspecs "
                        f"(e.g. nanoplug_register_attention) with @nanoplug.api.hookimpl"
                    )
            except Exception as exc:  # a broken third-party plugin is reported, not fatal
                self.broken.append(BrokenPlugin(ep.name, source, f"{type(exc).__name__}: {exc}"))
                log.warning("plugin %r from %s failed to load: %s: %s", ep.name, source, type(exc).__name__, exc)

    def add_plugin_module(self, module: Any, source: str) -> list[tuple[str, str]]:
        """Check `module`'s API version, run its registrar hooks, and add what they register.

        All or nothing: a hook that raises leaves the registry as it was. Returns the (kind, name)
        pairs added. Entry points come through here; tests and embedders may call it directly.
        """
        version = getattr(module, "NANOPLUG_API_VERSION", None)
        label = getattr(module, "__name__", repr(module))
        if version != PLUGIN_API_VERSION:
            raise PluginLoadError(
                f"plugin module {label!r} ({source}) declares NANOPLUG_API_VERSION = {version!r}, but this "
                f"nanoplug speaks plugin API {PLUGIN_API_VERSION}; install a release of the plugin built for "
                f"API {PLUGIN_API_VERSION} (or set NANOPLUG_API_VERSION = nanoplug.api.PLUGIN_API_VERSION)"
            )
        newly_registered = not self.pm.is_registered(module)
        if newly_registered:
            self.pm.register(module)
        registrars = {kind: Registrar(kind) for kind in KIND_HOOKS}
        try:
            self.pm.check_pending()  # a misspelt hook name is an error, not a silent no-op
            others = [p for p in self.pm.get_plugins() if p is not module]
            for kind, hook in KIND_HOOKS.items():
                self.pm.subset_hook_caller(hook, remove_plugins=others)(register=registrars[kind])
            self._check_names(registrars, source)
        except Exception:
            if newly_registered:
                self.pm.unregister(module)
            raise
        added = []
        for kind, registrar in registrars.items():
            for name, cls, _ in registrar.added:
                self._commit(kind, name, cls, source)
                added.append((kind, name))
        return added

    def _check_names(self, registrars: dict[str, Registrar], source: str) -> None:
        """Refuse a name another source provides, unless the plugin asked to replace it."""
        taken = [f"{kind} plugin {name!r} is already provided by {self.entries[kind][name].source}"
                 for kind, registrar in registrars.items() for name, _, replace in registrar.added
                 if not replace and source != BUILTIN_SOURCE and name in self.entries[kind]
                 and self.entries[kind][name].source != source]
        if taken:
            raise PluginLoadError(
                "; ".join(taken) + "; choose another name, or replace it explicitly with "
                "register.add(name, cls, replace=True)"
            )

    def _commit(self, kind: str, name: str, cls: Any, source: str) -> None:
        """A plugin that asked to replace a name takes it over; built-ins never replace one."""
        old = self.entries[kind].get(name)
        if old is not None and old.source != source:
            if source == BUILTIN_SOURCE:
                return
            log.info("%s plugin %r from %s replaces the one from %s (replace=True)", kind, name, source, old.source)
        if old is not None and old.source == source:
            old.cls, old.error = cls, None
            return
        self.entries[kind][name] = PluginEntry(kind, name, source, cls=cls)

    # ------------------------------------------------------------------------------- lookups
    def _kind(self, kind: str) -> dict[str, PluginEntry]:
        if kind not in self.entries:
            raise UnknownPluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KIND_HOOKS)}")
        return self.entries[kind]

    def names(self, kind: str) -> list[str]:
        return sorted(self._kind(kind))

    def get(self, kind: str, name: str) -> Any:
        """The plugin class for `name`, imported now if it is a built-in."""
        entry = self._kind(kind).get(name)
        if entry is None:
            broken = [b for b in self.broken if b.name == name]
            if broken:
                b = broken[0]
                raise PluginLoadError(f"{kind} plugin {name!r} from {b.source} failed to load: {b.error}")
            valid = ", ".join(self.names(kind)) or "none"
            hint = f"; plugins that failed to load: {', '.join(b.name for b in self.broken)}" if self.broken else ""
            raise UnknownPluginError(f"unknown {kind} plugin {name!r}; valid names: {valid}, or 'auto'{hint}")
        if entry.cls is None:
            self._import_builtin(entry)
        return entry.cls

    def _import_builtin(self, entry: PluginEntry) -> None:
        """Import a built-in's "module:object" (its one declaration, in registry.toml), checked as any plugin is."""
        if entry.error is None:
            module_name, _, obj = entry.target.partition(":")
            try:
                cls = getattr(importlib.import_module(module_name), obj)
                Registrar(entry.kind).add(entry.name, cls)
                entry.cls = cls
            except Exception as exc:
                entry.error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
                    entry.error += " (this built-in is not part of this build yet)"
        if entry.cls is None:
            raise PluginLoadError(f"{entry.kind} plugin {entry.name!r} ({entry.target}) failed to import: {entry.error}")

    def reasons(self, kind: str, name: str, target: Target) -> list[str]:
        """What stops `name` from serving `target`; an import failure is a reason too."""
        try:
            cls = self.get(kind, name)
        except PluginLoadError as exc:
            return [str(exc)]
        try:
            return [str(r) for r in cls.unavailable(target)]
        except Exception as exc:
            return [f"its availability check raised {type(exc).__name__}: {exc}"]

    def passed_over(self, kind: str, name: str, target: Target) -> list[str]:
        """Why `"auto"` should prefer another plugin that can serve (the plugin's `passed_over`; none by default)."""
        check = getattr(self.get(kind, name), "passed_over", None)
        if check is None:
            return []
        try:
            return [str(r) for r in check(target)]
        except Exception as exc:
            return [f"its passed_over check raised {type(exc).__name__}: {exc}"]

    def resolve(self, kind: str, asked: str, target: Target, among: list[str] | None = None) -> Resolution:
        """Pick the plugin of `kind` for this engine: the named one if it can serve, or the best for "auto"
        (of `among`, best first, when given)."""
        if asked != "auto":
            cls = self.get(kind, asked)
            reasons = self.reasons(kind, asked, target)
            if reasons:
                others = [n for n in self.names(kind) if n != asked]
                raise PluginUnavailableError(
                    f"{kind} plugin {asked!r} cannot serve this config: " + "; ".join(reasons)
                    + f". Choose another ({', '.join(others) or 'none installed'}) or 'auto'"
                )
            res = Resolution(kind, asked, asked, cls)
            log.info(res.describe())
            for why in self.passed_over(kind, asked, target):
                log.warning("%s plugin %r serves this config, but %s", kind, asked, why)
            return res
        skipped: dict[str, list[str]] = {}
        fallback = None  # the best that can serve but asked to be passed over, if no other can
        for name in self.by_priority(kind) if among is None else among:
            reasons = self.reasons(kind, name, target)
            if not reasons:
                over = self.passed_over(kind, name, target)
                if not over:
                    res = Resolution(kind, asked, name, self.get(kind, name), skipped)
                    log.info(res.describe())
                    return res
                fallback = fallback or (name, over)
                reasons = [f"passed over: {r}" for r in over]
            skipped[name] = reasons
        if fallback is not None:
            name, caveats = fallback
            res = Resolution(kind, asked, name, self.get(kind, name),
                             {n: r for n, r in skipped.items() if n != name}, caveats)
            log.info(res.describe())
            return res
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in skipped.items()) or "none is installed"
        raise PluginUnavailableError(f"no {kind} plugin can serve this config: {detail}")

    def by_priority(self, kind: str) -> list[str]:
        """Names of `kind`, best first; a plugin that fails to import sorts last."""

        def key(name: str) -> tuple[int, str]:
            try:
                priority = getattr(self.get(kind, name), "priority", 0)
            except PluginLoadError:
                return (1 << 30, name)
            # checked at registration; a class changed since sorts last rather than failing every "auto"
            return (-priority, name) if isinstance(priority, int) and not isinstance(priority, bool) else (1 << 30, name)

        return sorted(self._kind(kind), key=key)


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry (discovery only; each engine keeps its own choices)."""
    global _default
    if _default is None:
        _default = Registry()
    return _default
