"""Typed options: the strict value types every option model uses, and `NoOptions`, a platform's default.

A platform declares its options as a pydantic model (`Platform.Options`); the engine validates the
part of `EngineConfig` under the platform's name through it (`cuda={"enforce_eager": True}`), so a
third-party platform's options are checked exactly as the built-ins' are. Numbers and switches are
strict: a value read from text and never converted is the caller's mistake, refused, not guessed at.
"""
from __future__ import annotations

import operator
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict


def _integer_scalar(value: Any) -> Any:
    """numpy's and torch's integer scalars become ints; anything else is left for the strict check."""
    if isinstance(value, (bool, int, float, str, bytes)) or not hasattr(value, "__index__"):
        return value
    try:
        return operator.index(value)  # numpy.int64(5) -> 5; numpy.bool_ and floats refuse
    except TypeError:
        return value


Int = Annotated[int, BeforeValidator(_integer_scalar), Strict()]
"""An int (or numpy/torch integer scalar); never a bool, a float or a string."""
Float = Annotated[float, Strict()]
"""A float or an int; never a bool or a string."""
Bool = Annotated[bool, Strict()]
"""True or False; never 1, "yes" or "false"."""


class NoOptions(BaseModel):
    """The options of a platform that declares none: any key given is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
