"""JSONSchemaBench (/work/shared/data/jsonschemabench: 400 real-world schemas) through both backends: every schema
is compiled by each, and a refused one is refused with a message; for a sample of the accepted ones, the default
model's outputs that finish with "stop" validate with `jsonschema`, every one. The whole set, and the figures,
are benchmarks/structured.py's (benchmarks/results_structured.md)."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from nanoplug import LLM, SamplingParams
from nanoplug.api import Constraint, ConstraintError
from nanoplug.engine.registry import Registry

DATA = Path("/work/shared/data/jsonschemabench")
SAMPLE = 20
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} (the shared test data) is not on this machine")


def schemas() -> list[tuple[str, dict]]:
    return [(f"{p.parent.name}/{p.name}", json.loads(p.read_text())) for p in sorted(DATA.glob("*/*.json"))]


@pytest.fixture(scope="module")
def model_dir():
    from nanoplug.checkpoint.default_model import default_model_path

    return str(default_model_path(progress=True))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from nanoplug.engine.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_every_schema_is_compiled_or_refused_with_a_message(backend, tokenizer, capsys):
    all_schemas = schemas()
    assert len(all_schemas) == 400
    compiler = Registry(load_entry_points=False).get("structured_output", backend)(tokenizer, 49152, [2, 0])
    accepted, refused = [], {}
    for name, schema in all_schemas:
        try:
            compiler.compile(Constraint("json", json.dumps(schema, ensure_ascii=False)))
            accepted.append(name)
        except ConstraintError as exc:
            refused[name] = str(exc)
    with capsys.disabled():
        print(f"\n{backend}: {len(accepted)} of {len(all_schemas)} schemas accepted, {len(refused)} refused")
    assert all(why.startswith(f"{backend} cannot compile this json constraint: ") and len(why) > 50
               for why in refused.values()), refused
    assert len(accepted) >= 0.9 * len(all_schemas)


def test_a_sample_of_accepted_schemas_gives_outputs_that_validate(model_dir):
    """Every 20th schema xgrammar accepts, at temperature 0 and 96 tokens at most: each that ends with "stop"
    validates (one that runs out of tokens is a valid prefix, which says nothing)."""
    with LLM(model_dir, max_model_len=2048, num_kv_blocks=48, kv_block_size=128, max_num_seqs=SAMPLE,
             cpu={"graphs": False}) as llm:
        structured = llm.engine.structured
        chosen = []
        for name, schema in schemas()[::len(schemas()) // SAMPLE]:
            try:
                structured.compiled(Constraint("json", json.dumps(schema, ensure_ascii=False)))
                chosen.append((name, schema))
            except ConstraintError:
                continue
        prompts = [f"<|im_start|>user\nWrite a JSON object that follows this schema:\n{json.dumps(s)[:1500]}"
                   "<|im_end|>\n<|im_start|>assistant\n" for _, s in chosen]
        params = [SamplingParams(temperature=0, max_tokens=96, structured_outputs={"json": s}) for _, s in chosen]
        outs = llm.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for (name, schema), out in zip(chosen, outs):
        o = out.outputs[0]
        if o.finish_reason == "stop":
            stopped += 1
            jsonschema.validators.validator_for(schema)(schema).validate(json.loads(o.text))
    assert len(chosen) >= SAMPLE - 2 and stopped >= len(chosen) // 2, (len(chosen), stopped)
