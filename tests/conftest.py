"""Fixtures shared by the test files: tiny seeded checkpoints written once per session."""
from __future__ import annotations

import os

import pytest
import torch


def _import_triton_for_the_interpreter() -> None:
    """Triton's own library functions (tl.sum, tl.zeros, tl.cdiv...) are made for the CPU interpreter or
    for a GPU once, when triton is first imported. The CPU tests run kernels under TRITON_INTERPRET=1,
    and any test that lists the plugins imports triton first; so on a machine without CUDA triton is
    imported here with the variable set, which is then restored (plugins read it on every call)."""
    if torch.cuda.is_available():
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except Exception:  # no triton here: the Triton tests say so themselves
        pass
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_the_interpreter()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 checkpoint (2 layers, head size 16, GQA 4:2) with the real Qwen3 tokenizer."""
    from nanoplug.bench.checkpoints import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("checkpoints") / "qwen3")


@pytest.fixture
def processes():
    """Start child processes through this (`processes.popen`, `.run`, `.adopt`): its finalizer kills
    whatever the test left running (the process, its group and its descendants), however the test ended."""
    from _processes import Processes

    owned = Processes()
    yield owned
    owned.close()
