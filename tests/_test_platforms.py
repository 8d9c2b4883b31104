"""A registry holding one test-only platform (a CPU platform that borrows a CUDA kernel under the Triton
interpreter), registered as a third-party plugin module would register it."""
from __future__ import annotations

import types

from nanoplug.api import PLUGIN_API_VERSION, hookimpl
from nanoplug.engine.registry import Registry


def registry_with_platform(name: str, platform: type) -> Registry:
    """A registry without entry points that knows the built-ins and `platform` under `name`."""
    return registry_with_plugin("platform", name, platform)


def registry_with_plugin(kind: str, name: str, cls: type) -> Registry:
    """A registry without entry points that knows the built-ins and `cls` as the `kind` plugin `name`, registered
    as a third-party plugin module registers it (its kind's registrar hook)."""
    module = types.ModuleType(f"test_{kind}_{name}")
    module.NANOPLUG_API_VERSION = PLUGIN_API_VERSION
    setattr(module, f"nanoplug_register_{kind}", hookimpl(lambda register: register.add(name, cls)))
    registry = Registry(load_entry_points=False)
    registry.add_plugin_module(module, "test")
    return registry
