"""Triton kernels run on a CPU only under TRITON_INTERPRET=1, which must be set before the kernels are defined: a
module of them is reloaded with it set, and reloaded again afterwards, so no later test inherits the interpreter."""
from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Iterator

import pytest


@contextlib.contextmanager
def interpreted(*modules: ModuleType) -> Iterator[ModuleType]:
    """`modules` reloaded under the interpreter, in order (a module after those whose kernels its kernels call),
    for the length of the block; the last is given. Each must have imported triton."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        loaded = [importlib.reload(module) for module in modules]
        for module in loaded:
            assert module.triton is not None, f"triton does not import: {module.TRITON_ERROR}"
        yield loaded[-1]
    for module in modules:
        importlib.reload(module)
