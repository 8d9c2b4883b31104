"""Triton kernels run on a CPU only under TRITON_INTERPRET=1, which must be set before the kernels are defined: a
module of them is reloaded with it set, and reloaded again afterwards, so no later test inherits the interpreter."""
from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Iterator

import pytest


@contextlib.contextmanager
def interpreted(module: ModuleType) -> Iterator[ModuleType]:
    """`module` reloaded under the interpreter (it must have imported triton), for the length of the block."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        module = importlib.reload(module)
        assert module.triton is not None, f"triton does not import: {module.TRITON_ERROR}"
        yield module
    importlib.reload(module)
