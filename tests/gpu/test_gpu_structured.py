"""Structured outputs on CUDA: a batch under JSON schemas (overlapped steps, graphs, a bitmask big enough for the
numpy-staged copy) samples only tokens its grammars allow, and greedy output equals the CPU engine's.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_structured.py`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared helpers in tests/

from _checkpoints import checkpoint  # noqa: E402
from nanoplug import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
OPTIONS = dict(kv_block_size=16, num_kv_blocks=256, max_model_len=256, max_num_seqs=16, dtype="float32")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_constrained_batch_on_cuda_follows_its_grammars_and_equals_the_cpu_engine(backend):
    pytest.importorskip(backend)
    prompts = [f"Item {i}: " for i in range(12)]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs={"json": SCHEMA})
               for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": r"[a-z]{3,12}\.[0-9]{2}"})
    with LLM(checkpoint(), device="cuda", structured_output=backend, **OPTIONS) as llm:
        assert llm.engine.overlap and llm.engine.defers_sampling
        outs = llm.generate(prompts, sampled, use_tqdm=False)
        on_gpu = llm.generate(prompts[:4], greedy, use_tqdm=False)
    finished = [o.outputs[0] for o in outs]
    assert all(o.finish_reason in ("stop", "length") for o in finished)  # "abort": a token outside the grammar
    stopped = [o for o in finished if o.finish_reason == "stop"]
    assert stopped, "some outputs should complete their schema in 40 tokens"
    for o in stopped:  # (the GPU machine has no jsonschema: the schema's rules by hand)
        value = json.loads(o.text)
        assert set(value) == {"name", "n"} and isinstance(value["name"], str) and len(value["name"]) <= 8
        assert isinstance(value["n"], int) and not isinstance(value["n"], bool)
    with LLM(checkpoint(), device="cpu", structured_output=backend, **OPTIONS) as llm:
        on_cpu = llm.generate(prompts[:4], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on_gpu] == [o.outputs[0].token_ids for o in on_cpu]
