"""Each platform's part of the config, validated through the platform's own options model, once at start-up.

`EngineConfig` takes any platform's options under its name (`cuda={...}`); which names are platforms,
and what each accepts, only the registry knows. Every part given is checked (a typo in `cuda={...}` fails
on a CPU machine too), before any weight is read; the chosen platform is built from its validated model.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from nanoplug.api import PluginLoadError
from nanoplug.config import EngineConfig
from nanoplug.engine.registry import Registry


def validate_platform_options(registry: Registry, config: EngineConfig) -> dict[str, BaseModel]:
    """{platform name: its validated options} for every platform given options; a ValidationError (title
    EngineConfig, each error located at platform.option) names the platform, the option and what is valid."""
    platforms = registry.names("platform")
    errors: list[InitErrorDetails] = []
    validated: dict[str, BaseModel] = {}
    for name, part in config.platform_options.items():
        if name not in platforms:
            errors.append(_error((name,), part, f"not an EngineConfig field, and no platform {name!r} is registered to "
                                 f"take options under that name (platforms: {', '.join(platforms)})"))
            continue
        model = registry.get("platform", name).Options
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise PluginLoadError(f"platform {name!r}: its Options is {model!r}, not a pydantic model class")
        try:
            validated[name] = model.model_validate(part)
        except ValidationError as exc:
            valid = ", ".join(model.model_fields) or "none"
            for e in exc.errors(include_url=False):
                where = ".".join(map(str, e["loc"]))
                rule = e["msg"].removeprefix("Value error, ")
                if e["type"] == "extra_forbidden":
                    msg = f"platform {name!r} has no option {where!r}; its options: {valid}"
                else:
                    msg = f"platform {name!r}, option {where!r}: {rule}" if where else f"platform {name!r}: {rule}"
                errors.append(_error((name, *e["loc"]), e.get("input"), msg))
    if errors:
        raise ValidationError.from_exception_data("EngineConfig", errors)
    return validated


def _error(loc: tuple, value: Any, msg: str) -> InitErrorDetails:
    return {"type": PydanticCustomError("platform_option", msg.replace("{", "{{").replace("}", "}}")),
            "loc": loc, "input": value}
