"""The nanoplug plugin SDK: the only nanoplug module a plugin imports.

It holds the contract of every plugin kind (`interfaces`), the hook specs, `hookimpl` and the API
version, the step data a worker and a backend read (`step`), the narrow `Target` a plugin is judged
against, the linear-method seam, the worker protocol, and the layer library models build from
(`layers`). It imports nothing else of nanoplug: the engine depends on it, never the other way.
Its public names are pinned by tests/test_api.py, so a change to the SDK is a visible decision.
"""
from nanoplug.api.errors import (AdapterError, GraphCaptureError, ModelLoadError, NanoplugError, PluginLoadError,
                                 PluginUnavailableError, RequestError, UnknownPluginError, WeightShapeError)
from nanoplug.api.hookspecs import KIND_HOOKS, PLUGIN_API_VERSION, hookimpl, hookspec
from nanoplug.api.interfaces import (AdapterOptions, AttentionBackend, KVCacheStore, ModelArchitecture,
                                     ParallelStrategy, Platform, Plugin, PrefillGraphs, ProcessGroup, RequestAdapters,
                                     StepGraphs, WeightAdapter, WeightFormat)
from nanoplug.api.layers import (FusedOps, Layers, LinearBase, PagedAttention, ParallelLMHead, RMSNorm,
                                 RotaryEmbedding, SiluAndMul, StepContext, VocabParallelEmbedding, add_rms_norm,
                                 apply_rope, install_fused_ops, rms_norm, rope_inv_freq, silu_and_mul)
from nanoplug.api.linear import DenseLinearMethod, LinearMethod, check_shape, copy_weight
from nanoplug.api.triton_support import import_triton, interpreting, triton_reasons
from nanoplug.api.step import (AttentionMetadata, AttentionSpec, KVCacheSpec, KVLayer, LogitsProcessingBatch,
                               DraftBatch, LogprobsTensors, PromptLogprobsBatch, SamplingBatch, SlotInit, StepBatch, StepInputs,
                               StepLimits, StepResult, to_device)
from nanoplug.api.speculator import DraftModel, Speculator, SpeculatorSpec
from nanoplug.api.structured import (CONSTRAINT_KINDS, Constraint, ConstraintError, GrammarMatcher,
                                     StructuredOutputBackend, bitmask_words, unpack_bitmask)
from nanoplug.api.tool_calls import (HERMES_TOOL_CALLS, LLAMA3_JSON_TOOL_CALLS, MISTRAL_TOOL_CALLS, ToolCallFormat,
                                     pick_tool_call_format)
from nanoplug.api.target import ModelFacts, Target
from nanoplug.api.worker import StartupTimes, StepStats, Worker, WorkerMethod, WorkerReport

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
    "Speculator", "SpeculatorSpec", "DraftBatch", "DraftModel",
    # the worker protocol
    "Worker", "WorkerMethod", "WorkerReport", "StartupTimes", "StepStats",
    # the linear-method seam and the layer library
    "LinearMethod", "DenseLinearMethod", "check_shape", "copy_weight", "Layers", "LinearBase", "VocabParallelEmbedding",
    "ParallelLMHead", "RMSNorm", "rms_norm", "add_rms_norm", "RotaryEmbedding", "apply_rope", "rope_inv_freq",
    "SiluAndMul", "silu_and_mul", "FusedOps", "install_fused_ops", "PagedAttention", "StepContext",
    # where Triton kernels can run
    "import_triton", "interpreting", "triton_reasons",
    # errors a plugin raises
    "NanoplugError", "AdapterError", "ModelLoadError", "PluginLoadError", "PluginUnavailableError",
    "RequestError", "UnknownPluginError", "WeightShapeError", "GraphCaptureError",
]
