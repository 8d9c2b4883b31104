"""Checks on an engine's state that several test files share."""
from __future__ import annotations

import pytest

from nanoplug import LLM


def assert_idle(llm: LLM) -> None:
    """Nothing running, waiting or on the device, and every KV block back in the free list."""
    assert not llm.engine.scheduler.has_work() and llm.engine.in_flight is None
    assert not llm.engine.worker.pending
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.num_kv_blocks


def interrupt_generate(llm: LLM, at_step: int, *generate_args) -> None:
    """Run `llm.generate(*generate_args)` with Ctrl-C arriving at its `at_step`-th step."""
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == at_step:
            raise KeyboardInterrupt
        return real_step()

    llm.engine.step = failing_step
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(*generate_args, use_tqdm=False)
    finally:
        del llm.engine.step
