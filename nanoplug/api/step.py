"""One step as data: what the engine hands a worker (`StepBatch`, with its `SamplingBatch` and, when a
request asks for them, penalties and bias in `LogitsProcessingBatch`), what rank 0 gives back
(`StepResult`, logprobs in `LogprobsTensors`), the inputs a worker plans from it on the host
(`StepInputs`), and the metadata every attention backend and KV store reads (`AttentionMetadata`,
`AttentionSpec`, `KVCacheSpec`, `KVLayer`).

Padding is defined once, here: the KV cache has one scratch block past the blocks the engine hands
out; block tables are padded with it and padding tokens write their K/V into it. So every entry of
a block table names a real block, and no backend clamps or masks table entries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class SlotInit:
    """Fill a token-count slot before this step: its sequence's prompt tokens and output tokens so far."""

    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class LogitsProcessingBatch:
    """One step's penalties and logit biases, for the sample rows that have any (see nanoplug/worker/logits_processors.py).

    Penalized rows are listed in `rows`, each with its token-count slot and its three penalties;
    `inits` fill new slots first. The bias is flat (row, token id, value) triples over all biased rows."""

    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    inits: list[SlotInit] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_token_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)


@dataclass
class SamplingBatch:
    """Per-row sampling settings as plain lists (picklable, so they cross process boundaries)."""

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    seeds: list[int | None]
    positions: list[int]  # index of the token being sampled, for seeded noise
    processing: LogitsProcessingBatch | None = None  # penalties and bias; None when no row has any
    logprob_rows: list[int] = field(default_factory=list)  # rows that want the logprobs of their token
    num_top_logprobs: list[int] = field(default_factory=list)  # for each of them, how many alternatives
    # structured outputs: rows sampled under a grammar, and their packed allowed-token bitmask (int32 numpy
    # [len(mask_rows), ceil(vocab / 32)], bit j of word w allows token 32 w + j). mask_later: the bitmask comes
    # after the launch (Worker.sample), once the previous step's tokens have advanced the grammars
    mask_rows: list[int] = field(default_factory=list)
    bitmask: Any = None
    mask_later: bool = False

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)

    @property
    def temperature_only(self) -> bool:
        """No row filters its distribution (top-k, top-p, min-p) or asks for seeded noise."""
        return (all(k <= 0 for k in self.top_ks) and all(p >= 1.0 for p in self.top_ps)
                and all(p <= 0.0 for p in self.min_ps) and all(s is None for s in self.seeds))

    @classmethod
    def greedy(cls, rows: int) -> "SamplingBatch":
        """`rows` greedy rows (warm-ups, profiling, comparisons)."""
        return cls([0.0] * rows, [0] * rows, [1.0] * rows, [0.0] * rows, [None] * rows, [0] * rows)


@dataclass
class PromptLogprobsBatch:
    """The prompt positions a step scores: the input positions whose logits score the next prompt token,
    that token, and the most alternatives any of them asked for."""

    at: list[int]
    token_ids: list[int]
    top: int


@dataclass
class DraftBatch:
    """The draft tokens a speculative step verifies. A sequence with k drafts has k + 1 consecutive sample rows
    (its last token, then each draft, as one-token decode rows at consecutive positions); sample row `rows[j]`
    is checked against `tokens[j]`, the draft proposed for the position it predicts. The rows after a
    sequence's last draft (its bonus row) are sampled as usual."""

    rows: list[int]
    tokens: list[int]


@dataclass
class StepBatch:
    """One step's work as plain data (it crosses process boundaries under tensor parallelism)."""

    is_prefill: bool
    input_ids: list[int]
    starts: list[int]  # tokens already in the cache for each sequence
    query_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # sequences whose last computed token yields a new token
    sampling: SamplingBatch
    logits_rows: list[int] = field(default_factory=list)  # of sample_rows, the ones that want logits
    adapter_ids: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)  # KV blocks used for the first time: cleared first
    # input tokens not yet known on the host (overlapped steps): input_ids[i] for i in from_previous_at
    # is row from_previous_rows[k] of the previous step's sampled tokens, taken on the device
    from_previous_at: list[int] = field(default_factory=list)
    from_previous_rows: list[int] = field(default_factory=list)
    # (from, to) KV blocks copied after this step's forward: a prompt's partly filled last block, for the
    # other samples of an n > 1 request (nanoplug/engine/blocks.py, fork). sample_rows then repeats that sequence's row
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobsBatch | None = None  # None: no prompt position scored
    # a model whose layers mix windows (KVGroups.hybrid): the block tables of groups 1.. (block_tables is group
    # 0's), per group one table per row, each as long as the row's block_tables entry; empty otherwise
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    drafts: DraftBatch | None = None  # a speculative step's drafts to verify (None: no row checks one)


@dataclass(frozen=True)
class StepLimits:
    """The sizes steps stay within (from the engine's config), for platforms that prepare for them."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_decode_rows: int = 0  # rows a decode step may carry: max_num_seqs x (1 + k) where k drafts are verified

    @property
    def decode_rows(self) -> int:
        """The most one-token rows of a decode step (what decode graphs are captured up to)."""
        return max(self.max_num_seqs, self.max_decode_rows)


@dataclass
class LogprobsTensors:
    """Log-probabilities of R chosen tokens: each one's, its rank, and the K most likely tokens of its row.

    Computed on the device (nanoplug/worker/logprobs.py); `pack` makes one tensor of them to copy to the host."""

    logprobs: torch.Tensor  # [R] float32: the chosen token's
    ranks: torch.Tensor  # [R] int64: tokens at least as likely as it (1: the most likely)
    top_ids: torch.Tensor  # [R, K] int64, K the most any row asked for
    top_logprobs: torch.Tensor  # [R, K] float32

    def pack(self) -> torch.Tensor:
        """All four as one flat float64 tensor (token ids and ranks are exact in float64)."""
        return torch.cat([self.logprobs.double(), self.ranks.double(), self.top_ids.double().flatten(),
                          self.top_logprobs.double().flatten()])

    @classmethod
    def unpack(cls, flat: torch.Tensor, rows: int, k: int) -> "LogprobsTensors":
        """The inverse of `pack` for `rows` rows of `k` alternatives each."""
        lps, ranks, ids, tops = flat.split([rows, rows, rows * k, rows * k])
        return cls(lps.float(), ranks.long(), ids.long().view(rows, k), tops.float().view(rows, k))

    @classmethod
    def cat(cls, parts: list["LogprobsTensors"]) -> "LogprobsTensors":
        return cls(*(torch.cat(ts) for ts in zip(*((p.logprobs, p.ranks, p.top_ids, p.top_logprobs) for p in parts))))


@dataclass
class StepResult:
    """What rank 0 gives back for one step: the sampled token of each sample row, the logits rows asked
    for, and logprobs (host tensors) when the step's requests ask for them."""

    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: LogprobsTensors | None = None  # of sampling.logprob_rows' tokens
    prompt_logprobs: LogprobsTensors | None = None  # of the prompt tokens at StepBatch.prompt_logprobs.at
    accepted: list[bool] | None = None  # speculative steps: whether each of StepBatch.drafts.rows kept its draft


@dataclass
class StepInputs:
    """One step's inputs on the host, laid out as the device reads them.

    Planned in one place (nanoplug/worker/inputs.py) for eager steps and for graph replays alike. A
    graph replays a fixed number of rows R: rows past the batch's sequences are padding (one token
    each, at position 0, writing to the scratch block, context length 1)."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int32 [R], context length after this step
    cu_seqlens_q: np.ndarray  # int32 [R+1]
    cu_seqlens_k: np.ndarray  # int32 [R+1]
    block_tables: np.ndarray  # int32 [R, W], padded with the scratch block
    from_previous_at: np.ndarray  # int64 [K]: see StepBatch
    from_previous_rows: np.ndarray  # int64 [K]
    num_from_previous: int = 0
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    last_rows: np.ndarray | None = None  # int64 [R]: each sequence's last token, for a captured prefill
    # KV groups 1.. of a hybrid model (KVGroups): each group's padded block tables and its tokens' cache slots
    group_block_tables: list[np.ndarray] = field(default_factory=list)
    group_slot_mappings: list[np.ndarray] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the worker and read by every layer.

    Tokens of all sequences are packed along one axis. For sequence i, the step computes
    `query_lens[i]` new tokens at the end of a context of `seq_lens[i]` tokens (cached ones included),
    so its queries sit at positions `seq_lens[i] - query_lens[i] ... seq_lens[i] - 1`. Every entry of
    `block_tables` is a real block: padding names the scratch block (see the module's docstring).
    """

    is_prefill: bool
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    cu_seqlens_k: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B], context length after this step
    slot_mapping: torch.Tensor  # int64 [N], cache slot of each new token
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with the scratch block
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
class KVGroups:
    """The KV-cache groups of a model whose layers mix windows (vLLM's KV-cache groups, llama.cpp's SWA cache).

    Layers of one window (None: full attention) form groups of `num_slots` layers each (the last may have
    fewer); every group has its own block table per sequence, drawn from one pool of blocks, and a block holds
    `num_slots` layer pages: layer l keeps its K/V in cache tensor `layer_slot[l]`, which the l-th layer of every
    other group shares. So a sliding group gives back the blocks its window passed while the full group keeps
    them all, and a block costs `num_slots` pages, not one per layer. A model with one window kind (every layer
    full, or every layer over the same window) is one group of one slot per layer: the plain cache."""

    windows: tuple[int | None, ...]  # per group
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: its cache tensor
    num_slots: int

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1


def kv_groups(sliding_windows: tuple[int | None, ...], num_layers: int) -> KVGroups:
    """The groups of a model with these per-layer windows: the full-attention layers' first (group 0), then each
    window's, in groups as large as the smallest kind (vLLM's choice: no slot of a block is left unused there)."""
    windows = tuple(sliding_windows) or (None,) * num_layers
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if len(kinds) == 1:
        return KVGroups((kinds[0],), (0,) * num_layers, tuple(range(num_layers)), num_layers)
    layers_of = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    size = min(len(v) for v in layers_of.values())
    group_windows, layer_group, layer_slot = [], [0] * num_layers, [0] * num_layers
    for w in kinds:
        for first in range(0, len(layers_of[w]), size):
            for slot, layer in enumerate(layers_of[w][first:first + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(w)
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


@dataclass(frozen=True)
class KVCacheSpec:
    """How one engine's paged KV cache is laid out: each layer's K and V are
    `[num_blocks, block_size, num_kv_heads, head_dim]` of `dtype` (which may differ from the model's)."""

    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    # per-layer scales for quantized caches (float32 [num_layers]); None for plain caches
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class KVLayer:
    """One layer's view of the cache, handed to the store and the backend with its K/V caches."""

    index: int
    k_scale: torch.Tensor | None = None  # 0-d float32, for quantized caches
    v_scale: torch.Tensor | None = None
    # a store that keeps more per layer (e.g. a basis its cache is kept in) hands a subclass (KVCacheStore.layer)

    def dequantize(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V read from this layer's cache as `dtype`, scales applied (the plain way to read any cache;
        a store's subclass undoes whatever else it keeps them in)."""
        if self.k_scale is None:
            return k.to(dtype), v.to(dtype)
        return (k.float() * self.k_scale).to(dtype), (v.float() * self.v_scale).to(dtype)


@dataclass(frozen=True)
class AttentionSpec:
    """The shape of attention a backend is built for (this rank's heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    block_size: int
    dtype: torch.dtype  # of q, k, v and the output
    device: torch.device
    kv: KVCacheSpec | None = None  # the cache it reads; None: plain, of `dtype`
    limits: StepLimits | None = None  # the engine's step sizes, for backends that allocate for them; None: unknown
    # the model's declaration, per layer (KVLayer.index): keys a query sees, itself included; None: all. Empty:
    # full attention on every layer
    sliding_windows: tuple[int | None, ...] = ()
    softcap: float | None = None  # scores s (scale applied) become tanh(s / softcap) * softcap; None: off

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (a query at i sees keys j with i - window < j <= i), None: full."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def windows(self) -> set[int | None]:
        """The distinct windows of the model's layers (None for full attention)."""
        return set(self.sliding_windows) or {None}

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv.dtype if self.kv is not None else self.dtype


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, numpy array or CPU tensor) as a `dtype` tensor on `device`, copied asynchronously.

    A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host
    until all queued GPU work is done, and that would undo overlapped steps. Staging the copy through
    pinned memory lets it queue behind that work instead. A big array (a step's grammar bitmask) is copied into
    the pinned buffer by numpy: torch's copy would wake its CPU thread pool, whose threads then spin on the host's
    cores while the engine fills the next masks."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    if t.numel() >= _BIG and t.is_pinned():  # written into `host_array`'s memory: no staging
        return t.to(device, non_blocking=True)
    if t.numel() < _BIG or dtype not in _NUMPY_DTYPES:
        return t.pin_memory().to(device, non_blocking=True)
    pinned = torch.empty(t.shape, dtype=dtype, pin_memory=True)
    np.copyto(pinned.numpy(), t.numpy())
    return pinned.to(device, non_blocking=True)


def host_array(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> np.ndarray:
    """An empty host array that `to_device(array, dtype, device)` copies without staging it: pinned where `device`
    is CUDA and this process holds a CUDA context already (its worker runs here; a spawned pool's engine process
    gets no context of its own for this). A step's grammar bitmask, 1.2 MB at batch 64, is then written once, where
    the copy reads it. The caller must not rewrite it before that copy has run (the engine keeps two, in turn)."""
    pinned = device.type == "cuda" and torch.cuda.is_initialized()
    return torch.empty(shape, dtype=dtype, pin_memory=pinned).numpy()


_BIG = 16384  # elements from which torch's copy runs on its thread pool (its grain is 32768)
_NUMPY_DTYPES = (torch.int32, torch.int64, torch.float32, torch.bool, torch.uint8)
