"""Fixtures shared by the test files: tiny seeded checkpoints written once per session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 checkpoint (2 layers, head size 16, GQA 4:2) with the real Qwen3 tokenizer."""
    from nanoplug.checkpoints import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("checkpoints") / "qwen3")


@pytest.fixture
def processes():
    """Start child processes through this (`processes.popen`, `.run`, `.adopt`): its finalizer kills
    whatever the test left running (the process, its group and its descendants), however the test ended."""
    from _processes import Processes

    owned = Processes()
    yield owned
    owned.close()
