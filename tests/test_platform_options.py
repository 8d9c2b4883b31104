"""A third-party platform declares its own typed options (`Platform.Options`) and gets them validated and
delivered exactly as the built-ins do: `LLM(..., <name>={...})`, refused naming the platform, the option
and what is valid, before any file is read."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from _checkpoints import checkpoint
from _test_platforms import registry_with_platform
from nanoplug import LLM
from nanoplug.api import Platform
from nanoplug.api.options import Bool, Int, NoOptions
from nanoplug.plugins.platforms.cpu.options import CpuOptions
from nanoplug.plugins.platforms.cpu.platform import CpuPlatform

ENGINE = dict(kv_block_size=16, kv_cache="torch", attention="sdpa", max_model_len=128, device="cpu", dtype="float32",
              max_num_seqs=4, max_num_batched_tokens=256)


class BudgetOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kv_blocks: Int = Field(24, ge=8, description="KV blocks this platform hands the engine")
    loud: Bool = False


class BudgetCpu(CpuPlatform):
    """test-only: the cpu platform, its cache sized by its own option instead of by memory."""

    description = "test-only: the KV cache sized by budget_cpu.kv_blocks"
    Options = BudgetOptions

    def __init__(self, options: BudgetOptions, target):
        super().__init__(CpuOptions(), target)  # the cpu platform's defaults underneath
        self.options = options

    def num_kv_blocks(self, block_bytes, profile, release):
        return self.options.kv_blocks


@pytest.fixture(scope="module")
def registry():
    return registry_with_platform("budget_cpu", BudgetCpu)


def test_a_third_party_platforms_typed_options_reach_it(registry):
    default = LLM(checkpoint(), registry=registry, platform="budget_cpu", **ENGINE)
    assert isinstance(default.engine.worker.platform.options, BudgetOptions)  # its own model, with its defaults
    assert default.engine.num_kv_blocks == 24
    asked = LLM(checkpoint(), registry=registry, platform="budget_cpu", budget_cpu={"kv_blocks": 40}, **ENGINE)
    assert asked.engine.num_kv_blocks == 40
    assert asked.engine.worker.platform.options == BudgetOptions(kv_blocks=40)


@pytest.mark.parametrize("part, field, rule", [
    ({"kv_blocks": 4}, "budget_cpu.kv_blocks", "platform 'budget_cpu', option 'kv_blocks': Input should be greater "
                                               "than or equal to 8"),
    ({"loud": "yes"}, "budget_cpu.loud", "option 'loud': Input should be a valid boolean"),
    ({"blocks": 40}, "budget_cpu.blocks", "platform 'budget_cpu' has no option 'blocks'; its options: kv_blocks, loud"),
])
def test_a_third_party_platforms_options_are_refused_as_the_built_ins_are(registry, part, field, rule):
    with pytest.raises(ValidationError) as err:
        LLM("/no/such/checkpoint/needed", registry=registry, budget_cpu=part, **ENGINE)  # fails before any file is read
    (error,) = err.value.errors()
    assert ".".join(map(str, error["loc"])) == field and rule in error["msg"]


def test_options_for_a_platform_not_chosen_are_still_checked_and_unknown_names_are_refused(registry):
    with pytest.raises(ValidationError, match="cuda.memory_utilization"):
        LLM(checkpoint(), registry=registry, platform="budget_cpu", cuda={"memory_utilization": 2}, **ENGINE)
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'budgetcpu'.*budget_cpu=\{\.\.\.\}"):
        LLM(checkpoint(), registry=registry, budgetcpu={"kv_blocks": 40}, **ENGINE)


def test_a_platform_that_declares_no_options_refuses_any():
    class Bare(CpuPlatform):
        description = "test-only: no options"
        Options = Platform.Options  # the SDK's default: NoOptions

    assert Platform.Options is NoOptions
    with pytest.raises(ValidationError, match="platform 'bare' has no option 'kv_cache_gb'; its options: none"):
        LLM("/no/such/checkpoint/needed", registry=registry_with_platform("bare", Bare), bare={"kv_cache_gb": 1})
