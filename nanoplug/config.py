"""The run's choices, validated once: EngineConfig (how to serve) and SamplingParams (what to sample).

Wrong values fail here, naming the field and the rule, before any weight is read. Numbers and
switches are strict: `max_tokens="5"`, `max_tokens=True` or `enable_prefix_caching="no"` are a caller's
mistake (a value read from text and never converted), refused rather than guessed at. A float field
takes an int (0 means 0.0), and an int field takes numpy's and torch's integer scalars.
"""
from __future__ import annotations

import os
import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator, model_validator

from nanoplug.api.options import Bool, Float, Int, _integer_scalar

PluginName = Annotated[str, Field(min_length=1, pattern=r"^\S+$")]
"""A plugin name, or "auto": non-empty, no spaces."""

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_N = 128  # OpenAI's limit on samples per prompt


def _token_id_key(value: Any) -> Any:
    """A JSON object's keys are strings, so OpenAI clients send logit_bias as {"50256": -100}: a key
    that is an integer written in decimal becomes that int; anything else is left for the strict check."""
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        return int(value)
    return _integer_scalar(value)


TokenIdKey = Annotated[int, BeforeValidator(_token_id_key), Strict(), Field(ge=0)]
"""A token id as a mapping key: an int, or its decimal string (JSON); never a bool or a float."""


class AdapterSpec(BaseModel):
    """One weight adapter to apply while loading, e.g. a PEFT LoRA folder at some scale."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    kind: PluginName = "lora"
    path: str = Field(min_length=1)
    scale: Float = 1.0
    name: str | None = None
    merge: Bool = Field(True, description="merge into the weights at load (every request); False: chosen per "
                        "request by SamplingParams(adapter=name)")

    @property
    def label(self) -> str:
        """The name requests use: `name`, or else the adapter folder's name."""
        return self.name or Path(self.path).name


def _options_part(value: Any) -> Any:
    """A platform's options: a dict, or an instance of its options model (only the fields set count)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    if not isinstance(value, dict):
        raise ValueError("not an EngineConfig field; a platform's options go under its name as a dict, e.g. "
                         "cuda={'enforce_eager': True}")
    return value


class EngineConfig(BaseModel):
    """How one engine instance serves: the model, the plugin of each kind, and the memory limits.

    The fields are generic; what only one platform understands is given under that platform's name
    (`cpu={...}`, `cuda={...}`, a third-party platform's alike) and checked by its `Platform.Options`."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    model: str = Field(description="checkpoint folder (or a Hugging Face model id)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    platform: PluginName = Field("auto", description="the platform plugin (device family); auto: the device's")
    attention: PluginName = "auto"
    prefill_attention: PluginName | None = Field(None, description="a different backend for prefill steps")
    kv_cache: PluginName = "auto"
    parallel: PluginName = "auto"
    tensor_parallel_size: Int = Field(1, ge=1)
    adapters: list[AdapterSpec] = Field(default_factory=list)
    max_loras: Int = Field(0, ge=0, description="per-request adapter slots (vLLM's max_loras): above the number of "
                           "per-request adapters given, the rest stay free for `load_adapter` at run time")
    max_lora_rank: Int = Field(16, ge=1, description="the largest rank an adapter loaded at run time may have")
    quantization: PluginName | None = Field(
        "auto", description="the weight format of a quantized checkpoint (a GGUF file): 'auto' keeps the "
        "checkpoint's own format where a weight-format plugin serves it here (else dequantizes, saying why), a "
        "name asks for that plugin, None dequantizes every weight to dtype (the float32 reference)")
    max_model_len: Int = Field(4096, ge=1, description="longest prompt plus answer, in tokens; at most the "
                               "model's max_position_embeddings (NANOPLUG_ALLOW_LONG_MAX_MODEL_LEN=1 allows more); "
                               "when not given, 4096 or the model's limit if lower")
    max_num_seqs: Int = Field(256, ge=1)
    max_num_batched_tokens: Int = Field(16384, ge=1)
    kv_block_size: Int = Field(256, ge=1)
    num_kv_blocks: Int | None = Field(None, ge=1, description="fixed number of KV blocks; None sizes it from memory")
    enable_prefix_caching: Bool = True
    overlap_steps: Bool | None = Field(None, description="prepare step N+1 on the host while the device computes "
                                       "step N; None: the platform's default (on for CUDA) when the parallel "
                                       "strategy supports it")
    skip_tokenizer_init: Bool = Field(False, description="load no tokenizer (as vLLM's option): prompts must be token "
                                      "ids, outputs carry token ids and empty text, no stop strings or chat")
    seed: Int = 0
    structured_output: PluginName = Field("auto", description="the constrained-decoding backend (xgrammar, "
                                          "llguidance); auto: the best one installed")
    speculator: PluginName | None = Field(None, description="the proposer of draft tokens for speculative decoding "
                                          "(ngram, ...); None: no speculation")
    num_speculative_tokens: Int = Field(4, ge=1, le=16, description="the most draft tokens per sequence and step (the "
                                        "engine adapts it to acceptance and batch size)")
    adaptive_speculation: Bool = Field(True, description="drafts per step: the number whose steps measured the "
                                       "most output tokens per second at this batch size (0 when the batch is "
                                       "compute-bound); False: always ask num_speculative_tokens, as vLLM does")
    speculator_options: dict[str, Any] = Field(default_factory=dict, description="the speculator's own options, "
                                               "e.g. {'prompt_lookup_max': 5} for ngram")
    # every other keyword is a platform's options, under its name: cpu={"kernels": False}, cuda={...}, or a
    # third-party platform's; the engine validates each through that platform's own model (`Platform.Options`)
    __pydantic_extra__: dict[str, Annotated[dict[str, Any], BeforeValidator(_options_part)]] = Field(init=False)

    @property
    def platform_options(self) -> dict[str, dict[str, Any]]:
        """The options given for each platform, by name, as given (validated at engine start-up). pydantic's
        validate_assignment files the extras' own slot among them on every assignment: it is no platform."""
        return {k: v for k, v in (self.model_extra or {}).items() if k != "__pydantic_extra__"}

    @field_validator("model", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        """A pathlib.Path (any os.PathLike) names a folder as well as its string does."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("adapters", mode="before")
    @classmethod
    def _plain_paths(cls, value: Any) -> Any:
        """A plain path string means a LoRA at scale 1.0."""
        if isinstance(value, (str, dict, AdapterSpec)):
            value = [value]
        return [{"kind": "lora", "path": v} if isinstance(v, str) else v for v in value]

    @field_validator("adapters")
    @classmethod
    def _distinct_request_names(cls, value: list[AdapterSpec]) -> list[AdapterSpec]:
        """Requests pick per-request adapters (merge=False) by name, so no two may share one."""
        labels = [spec.label for spec in value if not spec.merge]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(f"several per-request adapters are named {', '.join(map(repr, twice))}; "
                             "give each a distinct name, e.g. {'path': DIR, 'name': 'sql', 'merge': False}")
        return value

    @field_validator("dtype", "device", mode="before")
    @classmethod
    def _from_torch(cls, value: Any) -> Any:
        """Accept torch.float16 or torch.device("cuda:0") as well as their names."""
        return str(value).removeprefix("torch.") if type(value).__module__ == "torch" else value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value == "auto" or value == "cpu" or value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError("device must be 'auto', 'cpu', 'cuda' or 'cuda:N'")

    @field_validator("kv_block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("kv_block_size must be a power of two (e.g. 16 or 256)")
        return value


class StructuredOutputsParams(BaseModel):
    """One constraint on a request's output (vLLM's StructuredOutputsParams): exactly one field set.

    json: a JSON schema (a dict, or its text); json_object: any JSON object; regex; choice: one of these
    strings; grammar: EBNF/GBNF (rules written `name ::= ...`) or else Lark; structural_tag: free text in which
    each of `structures` ({"begin", "schema", "end"}) is drawn under its schema once one of `triggers` (a prefix
    of its begin) is written, as vLLM's and xgrammar's structural tags (tool calls in running text); with
    "stop_after_first" the answer ends after one structure."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # vLLM's keyword `json` (an attribute of that name would shadow pydantic's BaseModel.json)
    json_schema: dict[str, Any] | Bool | str | None = Field(None, alias="json")
    json_object: Bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsParams":
        given = [name for name in type(self).model_fields if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            given = ["json" if name == "json_schema" else name for name in given]
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar, structural_tag; found "
                             + (", ".join(given) or "none"))
        if isinstance(self.json_schema, str):
            import json

            try:
                json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"json is not a JSON schema: {exc}") from None
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one string")
        if self.structural_tag is not None:
            _check_structural_tag(self.structural_tag)
        return self

    @cached_property
    def constraint(self) -> "Constraint":
        """As the backends compile it (plain text, so equal constraints share one compiled grammar)."""
        import json

        from nanoplug.api.structured import Constraint

        if self.json_schema is not None:
            schema = self.json_schema if isinstance(self.json_schema, str) else json.dumps(
                {} if self.json_schema is True else self.json_schema, ensure_ascii=False)
            return Constraint("json", schema)
        if self.json_object:
            return Constraint("json_object", "")
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.choice is not None:
            return Constraint("choice", json.dumps(self.choice, ensure_ascii=False))
        if self.structural_tag is not None:
            tag = _check_structural_tag(self.structural_tag)
            return Constraint("structural_tag", json.dumps({"triggers": tag["triggers"], "structures": [
                {"begin": t["begin"], "schema": t.get("schema", {}), "end": t.get("end", "")}
                for t in tag["structures"]], "stop_after_first": bool(tag.get("stop_after_first"))},
                ensure_ascii=False, sort_keys=True))
        return Constraint("grammar" if "::=" in self.grammar else "lark", self.grammar)


def _check_structural_tag(tag: dict[str, Any] | str) -> dict[str, Any]:
    """The tag as a dict, or a ValueError that says what is wrong with it."""
    import json

    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as exc:
            raise ValueError(f"structural_tag is not JSON: {exc}") from None
    shape = 'structural_tag must be {"triggers": [...], "structures": [{"begin": ..., "schema": {...}, "end": ...}]}'
    if not isinstance(tag, dict) or not isinstance(tag.get("triggers"), list) or not tag["triggers"] \
            or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise ValueError(shape)
    triggers = tag["triggers"]
    if not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be non-empty strings")
    for i, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end", ""), str) \
                or not isinstance(s.get("schema", {}), (dict, bool)):
            raise ValueError(f'structural_tag.structures.{i} must be {{"begin": "...", "schema": {{...}}, "end": "..."}}')
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag.structures.{i}.begin {s['begin']!r} starts with none of the triggers "
                             f"{triggers}")
    return tag


class SamplingParams(BaseModel):
    """What to sample for one request. temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    temperature: Float = Field(1.0, ge=0)
    top_k: Int = Field(0, ge=0, description="0 keeps every token")
    top_p: Float = Field(1.0, gt=0, le=1)
    min_p: Float = Field(0.0, ge=0, le=1)
    max_tokens: Int = Field(64, ge=1)
    ignore_eos: Bool = False
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] = Field(default_factory=list)
    seed: Int | None = None
    adapter: str | None = Field(None, description="name of a per-request adapter loaded at start-up")
    output_logits: Bool = Field(False, description="return the raw logits row of every generated token")
    n: Int = Field(1, ge=1, le=MAX_N, description="samples of the prompt; they share its prefill and prompt KV blocks")
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="per generated token: its log-probability "
                                 "and this many most likely alternatives (0: only its own); None: none")
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the same for each prompt token "
                                        "after the first (its prefill then skips the prefix cache)")
    presence_penalty: Float = Field(0.0, ge=-2, le=2, description="OpenAI's: subtracted once from every token "
                                    "already generated")
    frequency_penalty: Float = Field(0.0, ge=-2, le=2, description="OpenAI's: subtracted per time a token was "
                                     "already generated")
    repetition_penalty: Float = Field(1.0, gt=0, description="transformers': tokens of the prompt or output have "
                                      "positive logits divided, negative ones multiplied by it; 1 leaves them")
    logit_bias: dict[TokenIdKey, Annotated[Float, Field(ge=-100, le=100)]] = Field(
        default_factory=dict, description="token id -> value added to its logit before sampling (OpenAI's)")
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="constrain the output to a JSON schema, any JSON object, a regex, a choice or a grammar")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> "SamplingParams":
        """A copy, its derived flags (the cached properties below) worked out again from its own fields."""
        copy = super().model_copy(update=update, deep=deep)
        for name in _DERIVED:
            copy.__dict__.pop(name, None)
        return copy

    @cached_property
    def penalized(self) -> bool:
        """Whether sampling needs this request's token counts (any penalty away from its neutral value)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def processes_logits(self) -> bool:
        """Whether the logits change before sampling (penalties or a bias): False keeps the plain sampler path."""
        return self.penalized or bool(self.logit_bias)

    @cached_property
    def needs_sampler_extras(self) -> bool:
        """Whether sampling does anything beyond the plain draw for this request (one check per row per step)."""
        return self.processes_logits or self.logprobs is not None


_DERIVED = [name for name, value in vars(SamplingParams).items() if isinstance(value, cached_property)]
