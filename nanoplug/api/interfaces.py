"""The contract of each plugin kind: one small base class per kind, optional hooks declared with defaults.

A plugin is a class: its classmethod `unavailable(target)` lists what stops it from serving this
target (empty when it can), and its instance does the work. The core imports no plugin by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterator, Protocol

import torch
from pydantic import BaseModel

from nanoplug.api.errors import AdapterError
from nanoplug.api.linear import DenseLinearMethod, LinearMethod
from nanoplug.api.options import NoOptions
from nanoplug.api.step import (AttentionMetadata, AttentionSpec, KVCacheSpec, KVLayer, StepBatch, StepInputs,
                               StepLimits)
from nanoplug.api.target import ModelFacts, Target
from nanoplug.api.worker import Worker


class Plugin:
    """Base of every plugin class: a description, a priority for `"auto"`, and availability."""

    description: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        """Reasons this plugin cannot serve `target`; empty when it can. Name the fix in each."""
        return []

    @classmethod
    def passed_over(cls, target: Target) -> list[str]:
        """Reasons `"auto"` should choose another plugin that can serve `target` before this one, although this one
        can (e.g. a path much slower for this engine); it is still chosen by name, or by `"auto"` when no other
        can serve. Name the better choice in each."""
        return []

    @classmethod
    def notes(cls, target: Target) -> list[str]:
        """Facts `nanoplug plugins` shows under this plugin (e.g. choices measured on this machine); cheap."""
        return []


# ----------------------------------------------------------------------------------------- attention
class AttentionBackend(Plugin, ABC):
    """Computes attention of new queries against the paged KV cache.

    K/V of the new tokens are already stored in the cache when `forward` is called. The cache of one
    layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and the same for V, of
    `spec.cache_dtype` (a backend that cannot read some cache dtype says so in `unavailable`, from
    `target.cache_dtype`). A layer of a sliding-window model sees only the last `spec.window(layer.index)` keys
    (None: all); a backend that cannot honour that says so in `unavailable`, from `target.model.sliding_windows`.
    Table entries before a window may name the scratch block (the engine released those blocks). Where
    `spec.softcap` is set (Gemma-2), every score s (scale applied) becomes tanh(s / softcap) * softcap before the
    softmax; a backend that cannot do that refuses in `unavailable`, from `target.model.attn_softcap`.
    """

    supports_cuda_graphs: ClassVar[bool] = False
    """True when `prepare`/`forward` never read a device value on the host, so decode can be captured."""
    supports_prefill_graphs: ClassVar[bool] = False
    """True when prefill steps without cached context can be captured too: `forward` reads the step's
    lengths from the metadata's tensors and takes `max_seqlen_q` as an upper bound (a captured step runs
    with its bucket's token count, the tokens past the batch forming one padding sequence)."""
    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step metadata once, before the layers run (never inside a captured graph)."""
        self.meta = meta

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, layer: KVLayer) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, Hkv, D] (the new tokens); returns [N, H, D]."""


# --------------------------------------------------------------------------------------- KV cache
class KVCacheStore(Plugin, ABC):
    """Writes new K/V into the paged cache at their slots; decides what the cache stores them as."""

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """What K/V are stored as for a model of `model_dtype` (default: the same)."""
        return model_dtype

    def scales(self, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-layer (k_scale, v_scale) float32 [num_layers] for a quantized cache; None for a plain one."""
        return None

    def layer(self, index: int, spec: KVCacheSpec, device: torch.device, dtype: torch.dtype) -> KVLayer:
        """Layer `index`'s view of this cache, handed with its K/V caches to `store`, `attend` and the backend
        (once per cache allocation; `spec`'s scales already on `device`; `dtype`: the model's). A store that
        keeps more per layer returns a KVLayer subclass carrying it."""
        if spec.k_scale is None:
            return KVLayer(index)
        return KVLayer(index, spec.k_scale[index], spec.v_scale[index])

    def attend(self, backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, layer: KVLayer) -> torch.Tensor:
        """One layer's attention over this cache (PagedAttention's whole forward): store the new K/V, then
        the backend. A store whose cache a backend cannot read as it is (e.g. kept in another basis)
        transforms q, k, v before and the output after here."""
        self.store(k, v, k_cache, v_cache, slot_mapping, layer)
        return backend.forward(q, k, v, k_cache, v_cache, layer)

    @abstractmethod
    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, layer: KVLayer) -> None:
        """k, v: [N, Hkv, D] of the model's dtype; caches [num_blocks, block_size, Hkv, D]."""


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


class ParallelStrategy(Plugin, ABC):
    """Starts a worker on one or many processes and returns the `Worker` that drives them in lockstep.

    `start(make_worker)` builds a worker per rank with `make_worker(group)` and returns one `Worker`:
    the local one itself (`single`), or a proxy whose every method runs on every rank and returns
    rank 0's result (`tensor`).
    """

    supports_overlap: ClassVar[bool] = False
    """True when the returned worker's `launch` returns at once and `collect` later gives that step's
    tokens, with every rank able to read the next step's inputs from the last sampled tokens (the
    engine then overlaps host and device work)."""

    def __init__(self, target: Target):
        self.target = target

    @abstractmethod
    def start(self, make_worker: Callable[[ProcessGroup], Worker]) -> Worker: ...


# --------------------------------------------------------------------------------------- adapters
class AdapterOptions(Protocol):
    """What the user asked of one adapter (`AdapterSpec` in the engine's config)."""

    kind: str
    path: str
    scale: float
    name: str | None
    merge: bool

    @property
    def label(self) -> str: ...


class WeightAdapter(Plugin, ABC):
    """Changes checkpoint tensors as they load (a LoRA merged), or serves them per request. How layers
    hold their weights is a weight format's job (`WeightFormat`), not an adapter's."""

    def __init__(self, spec: AdapterOptions, facts: ModelFacts, base_config: Any):
        self.spec = spec
        self.facts = facts
        self.base_config = base_config

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Return the tensor to load under checkpoint name `name` (unsharded, as in the file)."""
        return tensor

    def finish(self) -> None:
        """Called after the last tensor; raise if part of the adapter was never applied."""

    @classmethod
    def serve_per_request(cls, model: torch.nn.Module, adapters: list["WeightAdapter"], group: ProcessGroup,
                          max_tokens: int, slots: int = 0, rank: int = 0) -> "RequestAdapters":
        """Instead of merging `adapters` (spec.merge False; they saw every tensor but left it as it was),
        change `model`'s layers so each token can use adapter id i (adapters[i - 1]) or none (0). `slots` above
        len(adapters): ids left free for `RequestAdapters.load` at run time, of rank up to `rank`."""
        raise NotImplementedError(
            f"adapter plugin {cls.__name__} cannot serve adapters per request; merge them (merge=True)"
        )


class RequestAdapters(ABC):
    """Adapters picked per request: layers changed once at start-up, the token-to-adapter map set per step."""

    graph_safe: bool = False
    """True when decode steps captured once (CUDA graphs) serve every later step's mix of adapters: `set_step`
    only refills device buffers the captured launches read, and no launch's shape depends on the step's
    adapters. False keeps decode eager while these adapters are loaded."""

    @abstractmethod
    def set_step(self, token_adapter_ids: torch.Tensor) -> None:
        """Adapter id (0: none) of each token of the next step, int64 [N] on the CPU; called once per step
        before the model runs (and before a CUDA graph replays)."""

    def load(self, adapter_id: int, adapter: WeightAdapter) -> None:
        """Put `adapter` (read and checked by its constructor) in slot `adapter_id`, whose previous adapter no
        running token uses any more; called between steps. Raise AdapterError saying why it does not fit."""
        raise AdapterError(f"{type(self).__name__} cannot load adapters at run time; give them at start-up")


# ---------------------------------------------------------------------------------- weight formats
class WeightFormat(Plugin):
    """How linear layers hold and apply the checkpoint's weights: the platform's plain method (`dense`), a
    quantized checkpoint's own blocks (`gguf`), or a quantization on load (`fp8`). One per engine, chosen
    by `quantization=` and the checkpoint's format; the loader asks it which tensors to keep as stored."""

    quant_method: ClassVar[str | None] = None
    """The checkpoint format whose weights it keeps as stored (the config's quantization_config.quant_method,
    "gguf" for a GGUF folder). None: it takes plain floating-point weights (a quantized checkpoint's arrive
    dequantized). quantization="auto" picks among the formats of the checkpoint's quant_method."""
    quantizes: ClassVar[bool] = False
    """True when it changes plain weights' values on load (fp8): chosen by name only, never by "auto"."""
    kept_types: ClassVar[frozenset[str]] = frozenset()
    """GGUF tensor types (block formats, e.g. "Q4_0") the loader hands over as stored (a GGUFTensor: shape,
    a range of rows, `blocks()`); every other tensor arrives dequantized to float32."""

    def __init__(self, target: Target, hf_config: Any):
        self.target = target
        self.hf_config = hf_config

    def linear_method(self) -> LinearMethod | None:
        """The method every linear layer uses; None: the platform's dense one."""
        return None

    def regroup(self, tensors: Iterator[tuple[Any, str, Any]]) -> Iterator[tuple[Any, str, Any]]:
        """The checkpoint's (file, name, tensor) stream as the layers take it (default: as it is). A format whose
        layer weights are several tensors (qweight, scales, zeros) joins each layer's into one `<layer>.weight`."""
        return tensors

    def transform(self, name: str, tensor: Any) -> Any:
        """The tensor to load under checkpoint name `name`, after the adapters' merges (default: as it is)."""
        return tensor

    def finish(self) -> None:
        """Called after the last tensor."""


# ----------------------------------------------------------------------------------------- models
class ModelArchitecture(Plugin):
    """A model plugin is an `nn.Module` class with this mixin.

    `__init__(hf_config, layers, attention_factory, max_positions)` builds it from the layer library
    (`layers`: a `nanoplug.api.Layers` bound to the process group and the linear method;
    `attention_factory(layer_idx, num_heads, num_kv_heads, head_dim)`: a `PagedAttention`),
    `forward(input_ids, positions) -> hidden`, `compute_logits(hidden) -> logits`, and
    `packed_modules_mapping` tells the loader which checkpoint tensors are parts of fused layers.
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {}
    tool_call_formats: ClassVar[tuple[Any, ...]] = ()
    """How this model writes tool calls in its text (`nanoplug.api.ToolCallFormat`s): the one a checkpoint's chat
    template writes is picked by its marker, else the first (`pick_tool_call_format`). None declared: the server
    answers tool_choice "auto" by refusing, and "required"/named ones still work (under a grammar)."""

    def keep_hidden_states(self, layer_ids: list[int]) -> Callable[[], list[Any]] | None:
        """Keep, at each forward, the hidden states entering layers `layer_ids` (id num_layers: the last layer's
        output, before the final norm) for a speculator that reads them (EAGLE); returns a function giving the last
        forward's, one [tokens, hidden] tensor per id. None (the default): this model cannot."""
        return None

    def embed(self, input_ids: Any) -> Any:
        """The input embeddings of `input_ids` (for a speculator's head that shares them)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its input embeddings")

    def install_fused_ops(self, ops: Any) -> bool:
        """Take other implementations of the small ops (a platform's kernels, compiled ops; a `FusedOps`).
        Default: every RMSNorm, SiluAndMul and RotaryEmbedding of the layer library in this model takes
        them. Returns whether any layer did (a model with its own ops keeps them)."""
        from nanoplug.api.layers.fused import install_fused_ops

        return install_fused_ops(self, ops) > 0


# ---------------------------------------------------------------------------------------- platform
class StepGraphs(ABC):
    """Decode steps captured for some batch sizes (a platform's graphs), replayed on new inputs."""

    captures: int = 0
    """Graphs captured (recorded) so far, counted by the platform at each: all at start-up, none after."""
    graphs: dict[int, Any]
    """The captured steps by batch size, in increasing order of size."""

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that serves `num_seqs` sequences, or None (the step runs eager)."""
        return next((size for size in self.graphs if size >= num_seqs), None)

    @abstractmethod
    def inputs(self, size: int) -> StepInputs:
        """Host buffers (with room for `size` rows) for the next replay's inputs, to be planned into."""

    prefill: "PrefillGraphs | None" = None
    """Prefill steps without cached context captured for token-count buckets, where the platform took them."""

    @abstractmethod
    def replay(self, size: int, inputs: StepInputs, previous_tokens: torch.Tensor | None) -> torch.Tensor:
        """Run the graph of `size` on `inputs` (planned into `self.inputs(size)`); the logits [size, vocab]."""


class PrefillGraphs(ABC):
    """Fresh prefill steps (every sequence starts at position 0) captured for token-count buckets: a small
    prefill is then one launch instead of a few hundred, which is most of its time to first token."""

    max_seqs: int
    """The most sequences one captured prefill takes (the step's; a padding sequence comes on top)."""
    sizes: tuple[int, ...]
    """The captured token counts, in increasing order."""

    def size_for(self, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest captured token count that serves the step, or None (it runs eager)."""
        if num_seqs > self.max_seqs:
            return None
        return next((size for size in self.sizes if size >= num_tokens), None)

    @abstractmethod
    def inputs(self, size: int) -> StepInputs:
        """Host buffers for the next replay of `size` tokens (`last_rows` included), to be planned into."""

    @abstractmethod
    def replay(self, size: int, inputs: StepInputs) -> torch.Tensor:
        """Run the graph of `size` tokens; the logits of each sequence's last token [max_seqs, vocab]."""


class StepContextLike(Protocol):
    """What a platform may do with the worker's step context (nanoplug.api.layers.StepContext)."""

    def set_step(self, meta: AttentionMetadata) -> None: ...


class Platform(Plugin):
    """A device family (`cpu`, `cuda`, or out of tree): everything specific to it, so the engine and the
    runner stay generic. One instance lives on each worker; the engine also asks its classmethods."""

    device_type: ClassVar[str] = ""
    """The torch device type it serves ("cpu", "cuda", ...)."""
    Options: ClassVar[type[BaseModel]] = NoOptions
    """Its typed options (a pydantic model): the engine validates `EngineConfig(<name>={...})` through it."""
    require_graphs: bool = False
    """Its options ask for decode graphs: a failed capture stops start-up instead of decoding eager."""

    def __init__(self, options: BaseModel, target: Target):
        """options: an instance of its `Options`, validated from the config's part under its name."""
        self.options = options
        self.target = target
        self.device = target.device  # this rank's, once `worker_device` has chosen it

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if target.device.type != cls.device_type:
            return [f"serves {cls.device_type} devices, not {target.device.type}"]
        return []

    @classmethod
    def default_dtype(cls, saved: torch.dtype | None) -> torch.dtype:
        """The dtype for dtype='auto', given the checkpoint's saved dtype (None: unknown)."""
        return torch.float32

    @classmethod
    def overlaps_by_default(cls) -> bool:
        """Overlapped steps when overlap_steps=None (off where the host computes the step itself)."""
        return False

    # ------------------------------------------------------------------ on each worker, at start-up
    def worker_device(self, device: torch.device, group: ProcessGroup) -> torch.device:
        """The device of this rank (one device per rank under tensor parallelism)."""
        self.device = device
        return device

    def linear_method(self) -> LinearMethod:
        """How linear layers hold and apply dense weights here (unless a weight format gives its own)."""
        return DenseLinearMethod()

    def greedy_sampler(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A faster `logits.argmax(dim=-1)` here (same ties: the first maximum), or None."""
        return None

    def temperature_sampler(self) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
        """A faster draw for rows sampled at a temperature alone (no top-k, top-p, min-p or seed), or None:
        `(logits [rows, vocab], temperatures [rows] float32 > 0, seed: int) -> tokens [rows] int64`, each row's
        token drawn from softmax(logits / temperature), its noise keyed by `seed` (a new one every step)."""
        return None

    def inverse_cdf_sampler(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """A draw with one uniform number a row, for a platform where noise for every logit is slow (a CPU's
        generator), or None (an exponential race over each row's probabilities): `(weights [rows, vocab] float32
        >= 0, not normalised, uniforms [rows] float32 in (0, 1]) -> tokens [rows] int64`, token i drawn where
        u * sum(weights) falls in its share of the row's cumulative sum (a weight of 0 never drawn). Used for rows
        filtered by top-k, top-p or min-p, seeded rows (their u keyed by (seed, position)) and speculative steps."""
        return None

    def grammar_masker(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
        """A faster way to set the tokens a grammar forbids to -inf (structured outputs), or None:
        `(logits [rows, vocab], bitmask int32 [masked, words] on the device, rows int64 [masked] on the device or
        None for every row in order) -> a masked copy`; bit j of word w allows token 32 w + j, and tokens past
        the words are forbidden (as `unpack_bitmask`)."""
        return None

    def grammar_sampler(self) -> Callable[..., torch.Tensor] | None:
        """`temperature_sampler` under a grammar's bitmask in the same pass (structured outputs: no masked copy of
        the logits), or None: `(logits [rows, vocab], temperatures [rows] float32 (0: the row's argmax), seed: int,
        bitmask int32 [masked, words] on the device, rows int32 [rows] on the device (the bitmask row of each
        logits row, -1 for a free row) or None for bitmask row i = logits row i) -> tokens [rows] int64`; the
        bitmask as `grammar_masker` reads it."""
        return None

    def num_kv_blocks(self, block_bytes: int, profile: Callable[[], None], release: Callable[[], None]) -> int:
        """How many KV blocks of `block_bytes` fit. `profile()` runs the largest step once on a small
        temporary cache, `release()` frees that cache, for platforms that size the cache from memory."""
        raise NotImplementedError(f"platform {type(self).__name__} cannot size the KV cache; pass num_kv_blocks")

    # True where allocate_kv_cache returns zeroed memory: every block then holds finite values from the start,
    # and the engine skips clearing each block before its first use (a launch in the step otherwise)
    kv_cache_zeroed = False

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The whole cache's memory (uninitialized is fine: each block is cleared before its first use,
        unless `kv_cache_zeroed`)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """After the weights are loaded and the cache allocated: fused kernels, compiled ops."""

    def warm_up(self, run: Callable[[StepBatch], Any], limits: StepLimits, num_blocks: int) -> None:
        """Run each kind of step once (kernels that compile on first use compile here)."""

    def capture_graphs(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       ctx: StepContextLike, limits: StepLimits, scratch_block: int,
                       prefill_forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                       ) -> StepGraphs | None:
        """Capture decode steps: `ctx.set_step(meta)` then `forward(input_ids, positions) -> logits` runs
        the model; padding writes to `scratch_block`. None: graphs are off here (decode runs eager). Raise
        `GraphCaptureError` (saying why and what to do) when graphs are on but cannot be captured: the
        worker records it and decodes eager, or stops start-up when `require_graphs`. `prefill_forward`
        (input_ids, positions, last_rows) -> the logits at last_rows is given when the prefill backend can
        be captured too: a platform may then also capture small fresh prefills (`StepGraphs.prefill`)."""
        return None

    def synchronize(self) -> None:
        """Wait for the work queued on this worker's device (start-up times each phase up to here)."""

    # ------------------------------------------------------------------------------------ per step
    def to_host(self, tokens: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Start copying a step's sampled tokens (and logits rows) to the host; returns them and a handle."""
        return tokens, rows, None

    def wait(self, handle: Any) -> None:
        """Block until the copy `to_host` started has arrived."""

    def release(self) -> None:
        """A closed worker has dropped its model, cache and graphs: hand their memory back, so the next
        engine in this process can size its cache from it."""
