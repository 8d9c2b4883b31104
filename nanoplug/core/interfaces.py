"""The contracts between the core and the plugins of each kind.

A plugin is a class: its classmethod `unavailable(target)` lists what stops it from serving this
target (empty when it can), and its instance does the work. The core imports no plugin by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

if TYPE_CHECKING:
    from nanoplug.core.config import AdapterSpec, EngineConfig

PLUGIN_API_VERSION = 1
"""Bumped when a contract below changes incompatibly; the registry refuses plugins built for another."""


@dataclass(frozen=True)
class ModelFacts:
    """What a plugin may need to know about the checkpoint to say whether it can serve it."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelFacts":
        """The numbers plugins judge a checkpoint by, read off a Hugging Face config."""
        heads = hf_config.num_attention_heads
        return cls(
            architecture=(getattr(hf_config, "architectures", None) or ["?"])[0],
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
        )


@dataclass(frozen=True)
class Target:
    """One engine's config, resolved device and dtype, and the model: what `unavailable` judges."""

    config: "EngineConfig"
    device: torch.device
    dtype: torch.dtype
    model: ModelFacts | None = None


class Plugin:
    """Base of every plugin class: a description, a priority for `"auto"`, and availability."""

    description: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        """Reasons this plugin cannot serve `target`; empty when it can."""
        return []


# ----------------------------------------------------------------------------------------- attention
@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the runner and read by every layer.

    Tokens of all sequences are packed along one axis. For sequence i, the step computes
    `query_lens[i]` new tokens at the end of a context of `seq_lens[i]` tokens (cached ones included),
    so its queries sit at positions `seq_lens[i] - query_lens[i] ... seq_lens[i] - 1`.
    """

    is_prefill: bool
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    cu_seqlens_k: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B], context length after this step
    slot_mapping: torch.Tensor  # int64 [N], cache slot of each new token (-1: do not store)
    block_tables: torch.Tensor  # int32 [B, max_blocks], -1 padded
    max_seqlen_q: int
    max_seqlen_k: int
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def has_cached_context(self) -> bool:
        """True when some sequence attends to keys it does not compute in this step."""
        return self.max_seqlen_k > self.max_seqlen_q or self.seq_lens_host != self.query_lens_host


@dataclass(frozen=True)
class AttentionSpec:
    """The shape of attention the backend is built for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    block_size: int
    dtype: torch.dtype
    device: torch.device


class AttentionBackend(Plugin, ABC):
    """Computes attention of new queries against the paged KV cache.

    K/V of the new tokens are already stored in the cache when `forward` is called. The cache of one
    layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and the same for V.
    """

    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step metadata once, before the layers run (never inside a captured graph)."""
        self.meta = meta

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, Hkv, D] (the new tokens); returns [N, H, D]."""


# --------------------------------------------------------------------------------------- KV cache
class KVCacheStore(Plugin, ABC):
    """Writes new K/V into the paged cache at their slots."""

    @abstractmethod
    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """k, v: [N, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot -1 means skip."""


# --------------------------------------------------------------------------------------- parallel
class ProcessGroup(ABC):
    """The tensor-parallel group one model replica shard lives in."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # the GPU index of this rank on its host

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    @abstractmethod
    def layers(self) -> Any:
        """The layer factory model plugins build from (linear, embedding, LM head bound to this group),
        so the core never names the parallel plugin whose layers they are."""


class Worker(ABC):
    """What a parallel strategy runs on every rank: the model runner."""

    @abstractmethod
    def call(self, method: str, *args: Any) -> Any: ...


class ParallelStrategy(Plugin, ABC):
    """Starts the model runner on one or many processes and drives them in lockstep.

    `start(make_worker)` builds a worker per rank with `make_worker(group)`; `call(method, *args)`
    runs `worker.method(*args)` on every rank and returns rank 0's result.
    """

    # True when call("launch", step) returns at once and call("collect") later gives that step's
    # tokens, with every rank able to read the next step's inputs from the last sampled tokens
    # (the engine then overlaps host and device work)
    supports_overlap = False

    def __init__(self, config: "EngineConfig"):
        self.config = config

    @abstractmethod
    def start(self, make_worker: Callable[[ProcessGroup], Any]) -> None: ...

    @abstractmethod
    def call(self, method: str, *args: Any) -> Any: ...

    def shutdown(self) -> None:
        """Stop every worker; safe to call twice."""


# --------------------------------------------------------------------------------------- adapters
class WeightAdapter(Plugin, ABC):
    """Changes checkpoint tensors as they load (a LoRA merge, a quantizer)."""

    def __init__(self, spec: "AdapterSpec", facts: ModelFacts, base_config: Any):
        self.spec = spec
        self.facts = facts
        self.base_config = base_config

    @abstractmethod
    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Return the tensor to load under checkpoint name `name` (unsharded, as in the file)."""

    def finish(self) -> None:
        """Called after the last tensor; raise if part of the adapter was never applied."""

    @classmethod
    def serve_per_request(cls, model: torch.nn.Module, adapters: list["WeightAdapter"], group: ProcessGroup,
                          max_tokens: int) -> "RequestAdapters":
        """Instead of merging `adapters` (spec.merge False; they saw every tensor but left it as it was),
        change `model`'s layers so each token can use adapter id i (adapters[i - 1]) or none (0)."""
        raise NotImplementedError(
            f"adapter plugin {cls.__name__} cannot serve adapters per request; merge them (merge=True)"
        )


class RequestAdapters(ABC):
    """Adapters picked per request: layers changed once at start-up, the token-to-adapter map set per step."""

    @abstractmethod
    def set_step(self, token_adapter_ids: torch.Tensor) -> None:
        """Adapter id (0: none) of each token of the next step, int64 [N] on the CPU; called once per step
        before the model runs (and before a CUDA graph replays)."""


# ----------------------------------------------------------------------------------------- models
class ModelArchitecture(Plugin):
    """A model plugin is an `nn.Module` class with these class attributes and methods.

    `__init__(hf_config, layers, attention_factory)`, `forward(input_ids, positions) -> hidden`,
    `compute_logits(hidden) -> logits`, and `packed_modules_mapping` for the loader.
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {}
