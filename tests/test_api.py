"""The plugin SDK, `nanoplug.api`: its public names are pinned here, so a change to the SDK is a visible
decision; it stands alone (importing it loads neither the engine nor any plugin); and the names users
had at the top level still work."""
from __future__ import annotations

import json
import subprocess
import sys

import nanoplug
import nanoplug.api as api

PINNED = [
    "PLUGIN_API_VERSION", "hookimpl", "hookspec", "KIND_HOOKS", "Plugin", "AttentionBackend", "KVCacheStore",
    "ProcessGroup", "ParallelStrategy", "WeightAdapter", "WeightFormat", "AdapterOptions", "RequestAdapters",
    "ModelArchitecture", "Platform", "StepGraphs", "PrefillGraphs", "Target", "ModelFacts", "StepBatch",
    "SamplingBatch", "StepResult", "StepInputs", "StepLimits", "AttentionMetadata", "AttentionSpec", "KVCacheSpec",
    "KVLayer", "to_device", "LogitsProcessingBatch", "PromptLogprobsBatch", "SlotInit", "LogprobsTensors",
    "StructuredOutputBackend", "GrammarMatcher", "Constraint", "ConstraintError", "CONSTRAINT_KINDS",
    "ToolCallFormat", "HERMES_TOOL_CALLS", "LLAMA3_JSON_TOOL_CALLS", "MISTRAL_TOOL_CALLS", "pick_tool_call_format",
    "bitmask_words", "unpack_bitmask", "Speculator", "SpeculatorSpec", "DraftBatch", "DraftModel",
    "HiddenStateSpeculator", "HiddenStateSource", "HiddenStep", "Worker", "WorkerMethod",
    "WorkerReport", "StartupTimes", "StepStats", "LinearMethod", "DenseLinearMethod", "ExpertRows", "check_shape",
    "copy_weight", "wide_linear", "Layers", "LinearBase", "VocabParallelEmbedding", "ParallelLMHead", "RMSNorm",
    "rms_norm", "add_rms_norm", "residual_stream", "RotaryEmbedding", "apply_rope", "rope_inv_freq", "SiluAndMul",
    "silu_and_mul", "FusedOps", "install_fused_ops",
    "PagedAttention", "StepContext", "import_reason", "import_triton", "interpreting", "triton_reasons",
    "NanoplugError", "AdapterError", "ModelLoadError", "PluginLoadError", "PluginUnavailableError", "RequestError",
    "UnknownPluginError", "WeightShapeError", "GraphCaptureError",
]


def test_the_public_names_are_pinned():
    assert api.__all__ == PINNED
    assert all(hasattr(api, name) for name in PINNED)
    assert api.PLUGIN_API_VERSION == 3


def test_the_sdk_loads_neither_the_engine_nor_a_plugin():
    code = ("import json, sys, nanoplug.api; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nanoplug'))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert loaded and all(m == "nanoplug" or m.startswith("nanoplug.api") for m in loaded), loaded


def test_the_top_level_names_still_work():
    assert nanoplug.hookimpl is api.hookimpl and nanoplug.PLUGIN_API_VERSION == api.PLUGIN_API_VERSION
    from nanoplug import LLM, EngineConfig, SamplingParams  # noqa: F401  (loaded on first use)

    assert set(nanoplug.__all__) <= set(dir(nanoplug))


def test_every_kind_has_a_hook_and_a_base_class():
    bases = {"attention": api.AttentionBackend, "kv_cache": api.KVCacheStore, "model": api.ModelArchitecture,
             "parallel": api.ParallelStrategy, "adapter": api.WeightAdapter,
             "weight_format": api.WeightFormat, "platform": api.Platform,
             "structured_output": api.StructuredOutputBackend, "speculator": api.Speculator}
    assert list(api.KIND_HOOKS) == list(bases)
    for kind, hook in api.KIND_HOOKS.items():
        assert hook == f"nanoplug_register_{kind}" and hasattr(api.hookspecs, hook)
        assert issubclass(bases[kind], api.Plugin)
