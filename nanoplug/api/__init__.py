"""The nanoplug plugin SDK: the only nanoplug module a plugin imports.

It holds the contract of every plugin kind (`interfaces`), the hook specs, `hookimpl` and the API
version, the step data a worker and a backend read (`step`), the narrow `Target` a plugin is judged
against, the linear-method seam, the worker protocol, and the layer library models build from
(`layers`). It imports nothing else of nanoplug: the engine depends on it, never the other way.
Its public names are pinned by tests/test_api.py, so a change to the SDK is a visible decision.
"""
# the errors and the hook specs are light (no torch): a command line can check its arguments and refuse
# within a second. The rest loads on first use of one of its names (PEP 562).
from nanoplug.api.errors import (AdapterError, GraphCaptureError, ModelLoadError, NanoplugError, PluginLoadError,
                                 PluginUnavailableError, RequestError, UnknownPluginError, WeightShapeError)
from nanoplug.api.hookspecs import KIND_HOOKS, PLUGIN_API_VERSION, hookimpl, hookspec

# each lazy name -> the module of the SDK that defines it
_LAZY = {name: f"nanoplug.api.{module}" for module, names in {
    "interfaces": ("AdapterOptions AttentionBackend KVCacheStore ModelArchitecture ParallelStrategy "
                   "Platform Plugin PrefillGraphs ProcessGroup RequestAdapters StepGraphs "
                   "WeightAdapter WeightFormat"),
    "layers": ("FusedOps Layers LinearBase PagedAttention ParallelLMHead RMSNorm RotaryEmbedding "
               "SiluAndMul StepContext VocabParallelEmbedding add_rms_norm apply_rope "
               "install_fused_ops residual_stream rms_norm rope_inv_freq silu_and_mul"),
    "linear": "DenseLinearMethod ExpertRows LinearMethod check_shape copy_weight wide_linear",
    "triton_support": "import_reason import_triton interpreting triton_reasons",
    "step": ("AttentionMetadata AttentionSpec KVCacheSpec KVLayer LogitsProcessingBatch "
             "LogprobsTensors PromptLogprobsBatch SamplingBatch SlotInit StepBatch StepInputs "
             "StepLimits StepResult to_device DraftBatch"),
    "structured": ("CONSTRAINT_KINDS Constraint ConstraintError GrammarMatcher StructuredOutputBackend "
                   "bitmask_words unpack_bitmask"),
    "tool_calls": ("ToolCallFormat HERMES_TOOL_CALLS LLAMA3_JSON_TOOL_CALLS MISTRAL_TOOL_CALLS "
                   "pick_tool_call_format"),
    "speculator": "DraftModel HiddenStateSource HiddenStateSpeculator HiddenStep Speculator SpeculatorSpec",
    "target": "ModelFacts Target",
    "worker": "StartupTimes StepStats Worker WorkerMethod WorkerReport",
}.items() for name in names.split()}


__all__ = [
    # the plugin protocol
    "PLUGIN_API_VERSION", "hookimpl", "hookspec", "KIND_HOOKS",
    # one base class per kind, and what they are judged against
    "Plugin", "AttentionBackend", "KVCacheStore", "ProcessGroup", "ParallelStrategy", "WeightAdapter", "WeightFormat",
    "AdapterOptions", "RequestAdapters", "ModelArchitecture", "Platform", "StepGraphs", "PrefillGraphs", "Target", "ModelFacts",
    # one step as data
    "StepBatch", "SamplingBatch", "StepResult", "StepInputs", "StepLimits", "AttentionMetadata", "AttentionSpec",
    "KVCacheSpec", "KVLayer", "to_device", "LogitsProcessingBatch", "PromptLogprobsBatch", "SlotInit", "LogprobsTensors",
    # constrained decoding (structured outputs) and tool-call formats
    "StructuredOutputBackend", "GrammarMatcher", "Constraint", "ConstraintError", "CONSTRAINT_KINDS", "ToolCallFormat",
    "HERMES_TOOL_CALLS", "LLAMA3_JSON_TOOL_CALLS", "MISTRAL_TOOL_CALLS", "pick_tool_call_format", "bitmask_words",
    "unpack_bitmask",
    # speculative decoding: the proposer kind and the drafts a step verifies
    "Speculator", "SpeculatorSpec", "DraftBatch", "DraftModel", "HiddenStateSpeculator", "HiddenStateSource",
    "HiddenStep",
    # the worker protocol
    "Worker", "WorkerMethod", "WorkerReport", "StartupTimes", "StepStats",
    # the linear-method seam and the layer library
    "LinearMethod", "DenseLinearMethod", "ExpertRows", "check_shape", "copy_weight", "wide_linear", "Layers",
    "LinearBase", "VocabParallelEmbedding", "ParallelLMHead", "RMSNorm", "rms_norm", "add_rms_norm", "residual_stream",
    "RotaryEmbedding", "apply_rope", "rope_inv_freq", "SiluAndMul", "silu_and_mul", "FusedOps", "install_fused_ops",
    "PagedAttention", "StepContext",
    # where Triton kernels can run
    "import_reason", "import_triton", "interpreting", "triton_reasons",
    # errors a plugin raises
    "NanoplugError", "AdapterError", "ModelLoadError", "PluginLoadError", "PluginUnavailableError",
    "RequestError", "UnknownPluginError", "WeightShapeError", "GraphCaptureError",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nanoplug.api' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
