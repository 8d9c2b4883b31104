"""Structured outputs under `tensor` (the spawned pool, gloo on CPU): constrained requests mixed with free ones
give one process's tokens, one step at a time and overlapped (the masks filled after the launch, for tokens
the ranks read from rank 0's sampled ones), and every constrained output is accepted by its constraint."""
from __future__ import annotations

import json
import re

import pytest

import tensor_parallel_helpers as helpers
from nanoplug import LLM, SamplingParams

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}},
          "required": ["n", "s"], "additionalProperties": False}
CONSTRAINTS = [{"json": SCHEMA}, {"regex": r"[0-9]{2,4}-[a-c]+"}, {"choice": ["left", "right"]}, None]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from nanoplug.bench.checkpoints import write_random_checkpoint

    ckpt = str(write_random_checkpoint(tmp_path_factory.mktemp("tp_structured") / "qwen3", tie_word_embeddings=True))
    made = {"single": LLM(ckpt, parallel="single", **helpers.ENGINE_OPTIONS)}
    try:
        for name, overlap in (("plain", False), ("fast", True)):
            made[name] = LLM(ckpt, parallel="tensor", tensor_parallel_size=2, overlap_steps=overlap,
                             **helpers.ENGINE_OPTIONS)
        yield made
    finally:
        for llm in made.values():
            llm.close()


def test_constrained_requests_under_tensor_give_one_process_tokens(engines):
    fast = engines["fast"].engine
    assert fast.overlap and fast.defers_sampling  # masks are filled after the overlapped launch
    prompts = [helpers.PROMPTS[i % len(helpers.PROMPTS)] for i in range(len(CONSTRAINTS) * 2)]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=c) if c else
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
              for c in CONSTRAINTS for _ in range(2)]
    outs = {name: [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            for name, llm in engines.items()}
    for name in ("plain", "fast"):
        assert [(o.token_ids, o.finish_reason) for o in outs[name]] == \
            [(o.token_ids, o.finish_reason) for o in outs["single"]], name
    for out, c in zip(outs["single"], [c for c in CONSTRAINTS for _ in range(2)]):
        if c is None or out.finish_reason != "stop":
            continue  # (a random model may run a JSON string to max_tokens)
        if "json" in c:
            assert set(json.loads(out.text)) == {"n", "s"}
        elif "regex" in c:
            assert re.fullmatch(c["regex"], out.text)
        else:
            assert out.text in c["choice"]
    assert any(o.finish_reason == "stop" for o in outs["single"][2:6])  # the regex and choice ones end
