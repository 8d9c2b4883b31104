"""Every config field a model plugin reads is honoured or refused: the walk over each plugin's transformers
config class. A default config of each architecture is served (every field it has is classified: honoured,
inert or held at its one value), and changing any field outside those sets is a start-up refusal naming it."""
from __future__ import annotations

import pytest
import torch
import transformers

from nanoplug.api import ModelFacts, Target
from nanoplug.api.config_fields import INERT
from nanoplug.engine.registry import Registry

MODELS = ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
          "Gemma3ForCausalLM", "Gemma2ForCausalLM"]


def config_class(architecture: str):
    name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(architecture, architecture.replace("ForCausalLM", "Config"))
    return getattr(transformers, name)


def reasons(architecture: str, **fields) -> list[str]:
    config = config_class(architecture)(**fields)
    config.architectures = [architecture]
    cls = Registry(load_entry_points=False).get("model", architecture)
    return cls.unavailable(Target(torch.device("cpu"), torch.float32, ModelFacts.from_hf_config(config)))


@pytest.mark.parametrize("architecture", MODELS)
def test_every_field_of_a_default_config_is_classified(architecture):
    config = config_class(architecture)()
    cls = Registry(load_entry_points=False).get("model", architecture)
    unclassified = set(config.to_dict()) - INERT - cls.honoured_fields - set(cls.fixed_fields)
    assert not unclassified
    assert reasons(architecture) == []


CHANGES = [
    ("hidden_act", "gelu", "hidden_act"),  # (Gemma's is hidden_activation: hidden_act is a field it does not know)
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "dynamic"),
    ("some_new_switch", True, "some_new_switch"),
]


# (Phi-3's config itself takes no rope type but longrope: that one is refused below)
@pytest.mark.parametrize("architecture,field,value,words",
                         [(a, *c) for a in MODELS for c in CHANGES if not (a == "Phi3ForCausalLM" and c[2] == "dynamic")])
def test_a_field_the_plugin_does_not_implement_is_refused(architecture, field, value, words):
    got = reasons(architecture, **{field: value})
    assert got and any(words in r for r in got), got


def test_phi3_longrope_and_partial_rotary_are_refused():
    longrope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 48, long_factor=[2.0] * 48,
                    original_max_position_embeddings=4096)
    assert any("longrope" in r for r in reasons("Phi3ForCausalLM", rope_parameters=longrope,
                                                max_position_embeddings=8192))
    partial = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    assert any("partial_rotary_factor" in r for r in reasons("Phi3ForCausalLM", rope_parameters=partial))


def test_the_engine_refuses_such_a_checkpoint_at_start_up(tmp_path):
    from nanoplug import LLM
    from nanoplug.api import PluginUnavailableError
    from nanoplug.bench.checkpoints import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "gelu", "LlamaForCausalLM", hidden_act="gelu", tokenizer=False)
    with pytest.raises(PluginUnavailableError, match="hidden_act"):
        LLM(str(path), attention="manual", num_kv_blocks=8, max_model_len=64)


def test_gemma3_attention_softcapping_and_bidirectional_attention_are_refused():
    assert any("attn_logit_softcapping" in r for r in reasons("Gemma3ForCausalLM", attn_logit_softcapping=50.0))
    assert any("use_bidirectional_attention" in r
               for r in reasons("Gemma3ForCausalLM", use_bidirectional_attention=True))
