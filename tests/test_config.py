"""EngineConfig and SamplingParams: wrong values fail naming the field and the rule; LLM options are checked."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from nanoplug import LLM, AdapterSpec, EngineConfig, SamplingParams
from nanoplug.engine.platform_options import validate_platform_options
from nanoplug.engine.registry import Registry


def assert_rejected(model_cls, field: str, rule: str, **values):
    with pytest.raises(ValidationError) as err:
        model_cls(**values)
    (error,) = err.value.errors()
    assert ".".join(map(str, error["loc"])) == field
    assert rule in error["msg"]
    assert field.split(".")[0] in str(err.value)  # the printed message names the field too


@pytest.mark.parametrize("field, value, rule", [
    ("dtype", "float64", "'auto', 'float32', 'float16' or 'bfloat16'"),
    ("device", "gpu", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("device", "cuda:x", "device must be"),
    ("attention", "", "at least 1 character"),
    ("kv_cache", "my cache", "should match pattern"),
    ("tensor_parallel_size", 0, "greater than or equal to 1"),
    ("max_model_len", 0, "greater than or equal to 1"),
    ("max_num_seqs", -1, "greater than or equal to 1"),
    ("max_num_batched_tokens", 0, "greater than or equal to 1"),
    ("kv_block_size", 24, "kv_block_size must be a power of two"),
    ("kv_block_size", 0, "greater than or equal to 1"),
    ("seed", 1.5, "valid integer"),
    ("no_such_option", 1, "not an EngineConfig field; a platform's options go under its name"),
])
def test_engine_config_rejects_wrong_values_naming_field_and_rule(field, value, rule):
    top, _, sub = field.partition(".")
    assert_rejected(EngineConfig, field, rule, model="m", **{top: {sub: value} if sub else value})


def rejected_platform_option(field: str, rule: str, **parts):
    """The engine's check of each platform's part (at start-up, before any file is read) refuses it."""
    with pytest.raises(ValidationError) as err:
        validate_platform_options(Registry(load_entry_points=False), EngineConfig(model="m", **parts))
    (error,) = err.value.errors()
    assert ".".join(map(str, error["loc"])) == field and rule in error["msg"]
    assert field in str(err.value) and f"platform {field.split('.')[0]!r}" in str(err.value)


@pytest.mark.parametrize("field, value, rule", [
    ("cuda.memory_utilization", 1.5, "option 'memory_utilization': Input should be less than or equal to 1"),
    ("cuda.memory_utilization", 0, "greater than 0"),
    ("cpu.kv_cache_gb", float("inf"), "finite number"),
    ("cuda.enforce_eager", "maybe", "valid boolean"),
    ("cuda.enforce_eager", "false", "valid boolean"),
    ("cuda.memory_utilization", "0.5", "valid number"),
    ("cpu.kernels", "sometimes", "valid boolean"),
    ("cpu.kernels", 1, "valid boolean"),
    ("cpu.no_such_option", 1, "platform 'cpu' has no option 'no_such_option'; its options: kv_cache_gb, kernels"),
])
def test_platform_options_are_checked_by_their_platform_naming_platform_option_and_rule(field, value, rule):
    top, _, sub = field.partition(".")
    rejected_platform_option(field, rule, **{top: {sub: value}})


def test_platform_options_live_under_the_platform_name_and_are_validated_by_its_model():
    from nanoplug.plugins.platforms.cpu.options import CpuOptions
    from nanoplug.plugins.platforms.cuda.options import CudaOptions

    cfg = EngineConfig(model="m", cpu={"kernels": False}, cuda={"enforce_eager": True})
    assert cfg.platform_options == {"cpu": {"kernels": False}, "cuda": {"enforce_eager": True}}
    opts = validate_platform_options(Registry(load_entry_points=False), cfg)
    assert type(opts["cpu"]) is CpuOptions and type(opts["cuda"]) is CudaOptions
    assert (opts["cpu"].kernels, opts["cpu"].kv_cache_gb, opts["cuda"].enforce_eager) == (False, 4.0, True)
    assert EngineConfig(model="m", cpu=CpuOptions(kernels=False)).platform_options == {"cpu": {"kernels": False}}
    rejected_platform_option("cuda", "platform 'cuda': require_graphs=True asks for CUDA graphs, but enforce_eager",
                             cuda={"require_graphs": True, "enforce_eager": True})
    rejected_platform_option("npu", "not an EngineConfig field, and no platform 'npu' is registered to take options "
                             "under that name (platforms: cpu, cuda)",
                             npu={"cores": 8})


def test_the_old_flat_option_names_are_gone():
    for old in ("cpu_kv_cache_gb", "cpu_kernels", "gpu_memory_utilization", "enforce_eager", "compile_fused_ops"):
        with pytest.raises(ValidationError, match="not an EngineConfig field"):
            EngineConfig(model="m", **{old: 1})
        with pytest.raises(TypeError, match=f"unknown option.*'{old}'.*cpu=\\{{...\\}}, cuda=\\{{...\\}}"):
            LLM("m", **{old: 1})


def test_engine_config_defaults_and_conversions():
    cfg = EngineConfig(model="m", dtype=torch.bfloat16, device=torch.device("cpu"), adapters="/lora")
    assert (cfg.dtype, cfg.device, cfg.attention, cfg.kv_cache, cfg.parallel) == ("bfloat16", "cpu", "auto", "auto", "auto")
    assert cfg.adapters == [AdapterSpec(kind="lora", path="/lora")]
    assert EngineConfig(model="m", device="cuda:1").device == "cuda:1"


def test_engine_config_checks_assignments_too():
    cfg = EngineConfig(model="m")
    with pytest.raises(ValidationError, match="max_num_seqs"):
        cfg.max_num_seqs = 0


def test_adapter_spec_rules():
    assert_rejected(AdapterSpec, "path", "at least 1 character", path="")
    assert_rejected(AdapterSpec, "scale", "finite number", path="p", scale=float("nan"))
    assert_rejected(EngineConfig, "adapters.0.bogus", "Extra inputs", model="m", adapters=[{"path": "p", "bogus": 1}])


@pytest.mark.parametrize("field, value, rule", [
    ("temperature", -0.1, "greater than or equal to 0"),
    ("temperature", float("nan"), "finite number"),
    ("top_k", -1, "greater than or equal to 0"),
    ("top_p", 0, "greater than 0"),
    ("top_p", 1.1, "less than or equal to 1"),
    ("min_p", 2, "less than or equal to 1"),
    ("max_tokens", 0, "greater than or equal to 1"),
    ("stop", [""], "stop strings must not be empty"),
    ("stop_token_ids.0", [-3], "greater than or equal to 0"),
    ("seed", "abc", "valid integer"),
    ("temprature", 0.5, "Extra inputs are not permitted"),
    ("n", 0, "greater than or equal to 1"),
    ("n", 129, "less than or equal to 128"),
    ("logprobs", -1, "greater than or equal to 0"),
    ("logprobs", 21, "less than or equal to 20"),
    ("prompt_logprobs", 21, "less than or equal to 20"),
    ("presence_penalty", 2.5, "less than or equal to 2"),
    ("frequency_penalty", -2.01, "greater than or equal to -2"),
    ("repetition_penalty", 0, "greater than 0"),
    ("repetition_penalty", float("inf"), "finite number"),
    ("logit_bias.7", {7: 100.5}, "less than or equal to 100"),
    ("logit_bias.-3.[key]", {"-3": 1.0}, "greater than or equal to 0"),
    ("logit_bias.a.[key]", {"a": 1.0}, "valid integer"),
])
def test_sampling_params_reject_wrong_values_naming_field_and_rule(field, value, rule):
    assert_rejected(SamplingParams, field, rule, **{field.split(".")[0]: value})


def test_sampling_params_defaults_and_conversions():
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(stop="END").stop == ["END"]
    p = SamplingParams()
    assert (p.n, p.logprobs, p.prompt_logprobs, p.logit_bias) == (1, None, None, {})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    edges = SamplingParams(n=128, logprobs=20, prompt_logprobs=0, presence_penalty=-2, frequency_penalty=2,
                           logit_bias={0: -100, "5": 100})
    assert edges.logit_bias == {0: -100.0, 5: 100.0}
    with pytest.raises(ValidationError, match="frozen"):
        SamplingParams().max_tokens = 3


def test_llm_rejects_unknown_options_by_name(qwen3_dir):
    with pytest.raises(TypeError) as err:
        LLM(str(qwen3_dir), attenton="manual", max_tokens=5)
    msg = str(err.value)
    assert "unknown option(s) 'attenton', 'max_tokens' for LLM" in msg
    assert "valid options:" in msg and "attention" in msg and "kv_block_size" in msg


def test_llm_rejects_wrong_values_before_loading(qwen3_dir):
    with pytest.raises(ValidationError) as err:
        LLM(str(qwen3_dir), max_num_seqs=0)
    assert "max_num_seqs" in str(err.value) and "greater than or equal to 1" in str(err.value)


# strict types (issue 13, item 7): a value read from text or a bool is a caller's mistake, refused by name
@pytest.mark.parametrize("field, value, rule", [
    ("max_tokens", "5", "valid integer"),
    ("max_tokens", True, "valid integer"),
    ("max_tokens", 5.0, "valid integer"),
    ("top_k", "50", "valid integer"),
    ("temperature", "0.7", "valid number"),
    ("temperature", True, "valid number"),
    ("ignore_eos", 1, "valid boolean"),
    ("ignore_eos", "false", "valid boolean"),
    ("seed", "7", "valid integer"),
    ("stop_token_ids.0", ["2"], "valid integer"),
])
def test_sampling_params_are_strict_about_types(field, value, rule):
    assert_rejected(SamplingParams, field, rule, **{field.split(".")[0]: value})


@pytest.mark.parametrize("field, value, rule", [
    ("max_model_len", "4096", "valid integer"),
    ("max_model_len", True, "valid integer"),
    ("num_kv_blocks", 8.0, "valid integer"),
    ("kv_block_size", "16", "valid integer"),
    ("enable_prefix_caching", 0, "valid boolean"),
    ("seed", True, "valid integer"),
])
def test_engine_config_is_strict_about_types(field, value, rule):
    top, _, sub = field.partition(".")
    assert_rejected(EngineConfig, field, rule, model="m", **{top: {sub: value} if sub else value})


def test_strict_types_still_take_what_a_caller_means():
    import numpy as np

    p = SamplingParams(temperature=0, top_p=1, max_tokens=np.int64(5), seed=np.int32(3), stop_token_ids=[np.int64(2)])
    assert (p.temperature, p.top_p, p.max_tokens, p.seed, p.stop_token_ids) == (0.0, 1.0, 5, 3, [2])
    assert type(p.max_tokens) is int and type(p.temperature) is float
    assert EngineConfig(model="m", max_model_len=np.int64(512), cpu={"kv_cache_gb": 1}).max_model_len == 512
    from pathlib import Path

    assert EngineConfig(model=Path("/models/qwen3")).model == "/models/qwen3"
