"""benchmarks/gpu_moe.py on the CPU (`--tiny`): the kernel stage's figures, and the tensor-by-tensor random
checkpoint writer it uses, whose files transformers and nanoplug load into the same model."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from _checkpoints import prompt_ids, scratch_dir
from nanoplug import LLM, SamplingParams
from nanoplug.bench.checkpoints import write_large_random_checkpoint

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_moe.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_kernel_stage_reports_every_batch(tmp_path):
    out = tmp_path / "figures.json"
    assert _script().main(["--tiny", "--skip", "b", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["kernel"]
    assert set(figures) == {"1", "64", "256"}
    for row in figures.values():
        assert row["ms"] > 0 and row["tflops"] > 0 and row["tbs"] > 0 and row["error"] < 1e-5


@pytest.mark.parametrize("architecture,shape", [
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
])
def test_large_checkpoint_writer_loads_in_transformers_and_nanoplug(architecture, shape, monkeypatch):
    from transformers import AutoModelForCausalLM

    import nanoplug.bench.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "SHARD_BYTES", 1 << 20)  # several shards and their index
    folder = write_large_random_checkpoint(scratch_dir(f"large_{architecture}"), architecture, seed=3,
                                           dtype=torch.float32, tie_word_embeddings=False, **shape)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    hf, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = prompt_ids("qwen3")[0]
    with torch.no_grad():
        want = hf.eval().generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    llm = LLM(str(folder), kv_block_size=16, num_kv_blocks=16, max_model_len=64)
    assert llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].token_ids == want
