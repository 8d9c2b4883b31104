"""Per-request LoRA: several adapters live beside the base weights; each token adds its own adapter's update.

Every adapted linear layer gets all adapters' A matrices stacked into one `[S*K*R, in]` matrix and
their B matrices into one `[out, S*K*R]` matrix (S packed slices such as q/k/v, K adapters, R the
largest rank, zero-padded). Per step the runner hands over each token's adapter id once (`LoraSlots`),
and each layer adds `x @ A_k.T @ B_k.T` of the token's adapter k in one of two ways:

- `TiledSlots`, the Triton kernels of lora_kernels.py (on CUDA; on CPU under TRITON_INTERPRET=1): tokens
  grouped by adapter into tiles, each tile reading only its adapter's factors, so the cost follows the
  tokens, not the number of adapters loaded. The tile table lives in one device buffer `set_step` refills
  and the launches' shapes never depend on it, so decode runs under CUDA graphs (`graph_safe`);
- `MaskedSlots`, the plain path elsewhere and the reference the kernels are tested against: a 0/1 mask
  over the K*R columns, `y = base(x) + ((x @ A.T) * mask) @ B.T`, two matmuls over every adapter's factors.

Under tensor parallelism A and B are sharded as the base layer shards its weight (`local_part`): B like the weight of a
column-parallel layer (output rows, each packed slice at its offset), A like the weight of a
row-parallel layer (input columns, the update added before the all-reduce that sums the shards).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import AdapterError, LinearBase, RequestAdapters, to_device
from nanoplug.kernels.lora import triton_kernels as kernels
from nanoplug.plugins.adapters.lora.peft_folder import LoraModule, PeftLora


class LoraSlots(RequestAdapters):
    """The step's token-to-adapter map every adapted layer reads, kept in device buffers that CUDA graphs replay."""

    kernels = False  # whether the layers' updates run the Triton kernels

    def __init__(self, num_adapters: int, rank: int, dtype: torch.dtype, device: torch.device, max_tokens: int):
        self.num_adapters, self.rank, self.max_tokens = num_adapters, rank, max_tokens
        self.active = False  # some token of this step uses an adapter
        self.cuda = device.type == "cuda"
        self.layers: dict[str, tuple[MultiLoraLinear, list[Any]]] = {}  # wrapped layers by path, with their slices
        self.packed: dict[str, tuple[str, Any]] = {}  # the model's packed modules (q_proj -> qkv_proj, "q")

    def load(self, adapter_id: int, adapter: Any) -> None:
        load_slot(self, adapter_id, adapter.lora, adapter.spec.scale)

    def _check(self, token_adapter_ids: torch.Tensor) -> int:
        n = token_adapter_ids.shape[0]
        if n > self.max_tokens:
            raise RuntimeError(f"a step of {n} tokens exceeds the {self.max_tokens} the adapters were sized for")
        self.active = bool(token_adapter_ids.any())
        return n

    def needed(self) -> bool:
        """Eager steps without adapter tokens skip the update; a graph being captured always includes it."""
        return self.active or (self.cuda and torch.cuda.is_current_stream_capturing())


class TiledSlots(LoraSlots):
    """For the kernels: the step's adapted tokens grouped by adapter into tiles (lora_kernels.plan_tiles)."""

    kernels = True

    def __init__(self, num_adapters: int, rank: int, dtype: torch.dtype, device: torch.device, max_tokens: int):
        super().__init__(num_adapters, rank, dtype, device, max_tokens)
        self.graph_safe = self.cuda  # every launch reads the plan, whose buffer set_step refills before a replay
        self.plan = torch.full((kernels.plan_size(max_tokens, num_adapters),), -1, dtype=torch.int32, device=device)
        table = 3 * kernels.max_tiles(max_tokens, num_adapters)
        self.tiles, self.order = self.plan[:table], self.plan[table:]
        self.stale = False  # the table lists an earlier step's tiles (a graph replay would run them)

    def set_step(self, token_adapter_ids: torch.Tensor) -> None:
        self._check(token_adapter_ids)
        if self.active:
            plan = kernels.plan_tiles(token_adapter_ids.numpy(), self.num_adapters, self.max_tokens)
            self.plan[:plan.shape[0]].copy_(to_device(plan, torch.int32, self.plan.device))
        elif self.stale:
            self.tiles.fill_(-1)
        self.stale = self.active

    def add(self, layer: "MultiLoraLinear", x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return kernels.add_lora(x, y, layer.lora_a, layer.lora_b, self.tiles, self.order, layer.columns,
                                layer.num_slices, self.num_adapters, self.rank)


class MaskedSlots(LoraSlots):
    """For the plain path: a per-token 0/1 mask over the K*R columns of the stacked factors."""

    def __init__(self, num_adapters: int, rank: int, dtype: torch.dtype, device: torch.device, max_tokens: int):
        super().__init__(num_adapters, rank, dtype, device, max_tokens)
        onehot = torch.zeros(num_adapters + 1, num_adapters * rank)
        for k in range(num_adapters):
            onehot[k + 1, k * rank:(k + 1) * rank] = 1.0
        self.onehot = onehot.to(device, dtype)  # row i: the mask of a token using adapter id i (row 0: none)
        self.mask = torch.zeros(max_tokens, num_adapters * rank, dtype=dtype, device=device)
        self.filled = 0  # rows of `mask` that may be non-zero

    def set_step(self, token_adapter_ids: torch.Tensor) -> None:
        n = self._check(token_adapter_ids)
        if not self.active:
            if self.filled:
                self.mask[: self.filled].zero_()
                self.filled = 0
            return
        ids = to_device(token_adapter_ids, torch.int64, self.onehot.device)
        torch.index_select(self.onehot, 0, ids, out=self.mask[:n])
        if self.filled > n:
            self.mask[n: self.filled].zero_()
        self.filled = n

    def add(self, layer: "MultiLoraLinear", x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = F.linear(x, layer.lora_a).view(n, layer.num_slices, -1)
        h = (h * self.mask[:n].unsqueeze(1)).view(n, -1)
        return y.addmm_(h, layer.lora_b.t())


class MultiLoraLinear(nn.Module):
    """A linear layer plus the low-rank update of each token's adapter. Inputs are tokens x features."""

    def __init__(self, base: nn.Module, slots: LoraSlots, lora_a: torch.Tensor, lora_b: torch.Tensor, num_slices: int,
                 rows: dict[int, tuple[int, int]]):
        super().__init__()
        self.base, self.slots, self.num_slices = base, slots, num_slices
        self.register_buffer("lora_a", lora_a, persistent=False)  # [S*K*R, in]
        self.register_buffer("lora_b", lora_b, persistent=False)  # [out, S*K*R]
        if slots.kernels:  # the expand kernel's blocks of output rows, each in one slice
            self.register_buffer("columns", kernels.column_blocks(rows, lora_b.device), persistent=False)
        self.reduce_group = base.group if base.reduces else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.reduce_group
        if group is None:
            y = self.base(x)
            return self.slots.add(self, x, y) if self.slots.needed() else y
        y = self.base.partial(x)  # row parallel: add this shard's partial update before the sum over shards
        if self.slots.needed():
            y = self.slots.add(self, x, y)
        return group.all_reduce(y)


def _layer_of(module_name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """The model layer that computes a checkpoint module, and its slice there (q_proj -> qkv_proj, "q")."""
    for source, (fused, shard) in packed.items():
        if module_name.endswith("." + source):
            return module_name[: -len(source)] + fused, shard
    return module_name, None


def _stack(base: LinearBase, parts: dict[tuple[int, Any], tuple[LoraModule, float]], shards: list[Any],
           num_adapters: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[int, int]]]:
    """This rank's stacked A [S*K*R, in] and scaled B [out, S*K*R] of one layer, in float32, and the output
    rows (offset, count) each adapted slice's B fills."""
    out_local, in_local = base.output_size, base.input_size
    row = base.tp_dim == 1

    def shard_like_weight(full: torch.Tensor, local_shape: tuple[int, int], shard: Any):
        """This rank's part of `full`, placed where the layer's own loader would put the weight's, and the
        rows (offset, count) it fills."""
        local = torch.zeros(local_shape)
        offset, size, part = base.local_part(full, shard, split_dim_only=True)
        local.narrow(0, offset, size).copy_(part)
        return local, offset, size

    a = torch.zeros(len(shards), num_adapters, rank, in_local)
    b = torch.zeros(out_local, len(shards), num_adapters, rank)
    rows: dict[int, tuple[int, int]] = {}
    for (k, shard), (module, scale) in parts.items():
        s, r = shards.index(shard), module.rank
        scaled_b = module.b * module.scaling(scale)
        if row:
            a[s, k, :r] = shard_like_weight(module.a, (r, in_local), shard)[0]
            b[:, s, k, :r] = scaled_b
            rows[s] = (0, out_local)
        else:
            a[s, k, :r] = module.a
            local, offset, size = shard_like_weight(scaled_b, (out_local, r), shard)
            b[:, s, k, :r] = local
            rows[s] = (offset, size)
    return a.reshape(-1, in_local), b.reshape(out_local, -1), rows


def attach_multi_lora(model: nn.Module, loras: list[tuple[PeftLora, float]], max_tokens: int, num_slots: int = 0,
                      min_rank: int = 0) -> LoraSlots:
    """Wrap every linear layer any of `loras` (adapter ids 1..K, each with its scale) adapts: through the
    Triton kernels where they can run, else the plain masked path. With `num_slots` above K, ids K+1.. are
    left empty for adapters loaded at run time (`LoraSlots.load`), of rank up to `min_rank`: then every
    linear layer is wrapped, since a later adapter may target any of them."""
    packed = getattr(model, "packed_modules_mapping", {})
    targets: dict[str, dict[tuple[int, Any], tuple[LoraModule, float]]] = {}
    for k, (lora, scale) in enumerate(loras):
        for name, module in lora.modules.items():
            path, shard = _layer_of(name, packed)
            targets.setdefault(path, {})[(k, shard)] = (module, scale)
    num_slots = max(num_slots, len(loras))
    if num_slots > len(loras):
        for path, module in model.named_modules():
            if isinstance(module, LinearBase):
                targets.setdefault(path, {})
    rank = max([min_rank] + [m.rank for lora, _ in loras for m in lora.modules.values()])
    weight = next(model.parameters())
    slots_class = MaskedSlots if kernels.unavailable(weight.device, weight.dtype) else TiledSlots
    slots = slots_class(num_slots, rank, weight.dtype, weight.device, max_tokens)
    slots.packed = packed
    for path, parts in targets.items():
        base = model.get_submodule(path)
        if not isinstance(base, LinearBase):
            raise AdapterError(
                f"per-request LoRA adapts linear projections only, not {path} ({type(base).__name__}); "
                "merge this adapter instead (merge=True)"
            )
        fused = path.rpartition(".")[2]
        shards = [shard for fused_name, shard in packed.values() if fused_name == fused] or [None]
        a, b, rows = _stack(base, parts, shards, num_slots, rank)
        wrapped = MultiLoraLinear(base, slots, a.to(base.weight.device, base.weight.dtype),
                                  b.to(base.weight.device, base.weight.dtype), len(shards), rows)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, wrapped)
        slots.layers[path] = (wrapped, shards)
        if slots.kernels:  # compile its kernels at start-up, not in a request's step or inside a graph capture
            zeros = functools.partial(torch.zeros, dtype=weight.dtype, device=weight.device)
            slots.add(wrapped, zeros(1, base.input_size), zeros(1, base.output_size))  # no tiles yet: nothing runs
    return slots


def load_slot(slots: LoraSlots, adapter_id: int, lora: PeftLora, scale: float) -> None:
    """Adapter `lora` into slot `adapter_id` of every wrapped layer (zeros where it adapts nothing). Every
    layer's factors are built before any is written, so an adapter that does not fit leaves the slot as it was."""
    if not 1 <= adapter_id <= slots.num_adapters:
        raise AdapterError(f"adapter slot {adapter_id} does not exist; this engine has {slots.num_adapters}")
    rank = max(m.rank for m in lora.modules.values())
    if rank > slots.rank:
        raise AdapterError(f"adapter {str(lora.path)!r} has rank {rank}, above the {slots.rank} this engine's adapter "
                           f"slots hold; restart it with a larger max_lora_rank (--max-lora-rank {rank})")
    parts_of: dict[str, dict[tuple[int, Any], tuple[LoraModule, float]]] = {}
    for name, module in lora.modules.items():
        path, shard = _layer_of(name, slots.packed)
        if path not in slots.layers:
            raise AdapterError(f"adapter {str(lora.path)!r} targets {name}, which is not a linear projection of "
                               "this model; per request only linear projections can be adapted")
        parts_of.setdefault(path, {})[(0, shard)] = (module, scale)
    staged = {}
    for path, parts in parts_of.items():
        layer, shards = slots.layers[path]
        try:
            a, b, _ = _stack(layer.base, parts, shards, 1, slots.rank)
        except (RuntimeError, ValueError) as exc:
            raise AdapterError(f"adapter {str(lora.path)!r} does not fit this model at {path}: {exc}; load it with "
                               "the base model it was trained on") from exc
        staged[path] = (a, b)
    k, r = adapter_id - 1, slots.rank
    for path, (layer, _) in slots.layers.items():
        num_slices = layer.num_slices
        a_slot = layer.lora_a.view(num_slices, slots.num_adapters, r, -1)[:, k]
        b_slot = layer.lora_b.view(layer.lora_b.shape[0], num_slices, slots.num_adapters, r)[:, :, k]
        if path in staged:
            a, b = staged[path]
            a_slot.copy_(a.view(num_slices, r, -1))
            b_slot.copy_(b.view(-1, num_slices, r))
        else:
            a_slot.zero_()
            b_slot.zero_()
