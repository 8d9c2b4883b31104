"""Per-request LoRA: several adapters live beside the base weights; each token adds its own adapter's update.

Every adapted linear layer gets all adapters' A matrices stacked into one `[S*K*R, in]` matrix and
their B matrices into one `[out, S*K*R]` matrix (S packed slices such as q/k/v, K adapters, R the
largest rank, zero-padded). Per step the runner hands over each token's adapter id once; it becomes
a 0/1 mask over the K*R columns, so a layer computes

    y = base(x) + ((x @ A.T) * mask) @ B.T

with two small matmuls, no gather of weights per token and no loop over tokens or adapters; the
shapes never depend on which adapters a step uses, so CUDA graphs capture it as is. Under tensor
parallelism A and B are sharded as the base layer shards its weight (`local_part`): B like the weight of a
column-parallel layer (output rows, each packed slice at its offset), A like the weight of a
row-parallel layer (input columns, the update added before the all-reduce that sums the shards).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api import AdapterError, LinearBase, RequestAdapters, to_device
from nanoplug.plugins.adapters.peft_folder import LoraModule, PeftLora


class LoraSlots(RequestAdapters):
    """The per-token adapter mask all adapted layers read, kept in one buffer that CUDA graphs replay."""

    def __init__(self, num_adapters: int, rank: int, dtype: torch.dtype, device: torch.device, max_tokens: int):
        self.rank = rank
        onehot = torch.zeros(num_adapters + 1, num_adapters * rank)
        for k in range(num_adapters):
            onehot[k + 1, k * rank:(k + 1) * rank] = 1.0
        self.onehot = onehot.to(device, dtype)  # row i: the mask of a token using adapter id i (row 0: none)
        self.mask = torch.zeros(max_tokens, num_adapters * rank, dtype=dtype, device=device)
        self.filled = 0  # rows of `mask` that may be non-zero
        self.active = False  # some token of this step uses an adapter
        self.cuda = device.type == "cuda"

    def set_step(self, token_adapter_ids: torch.Tensor) -> None:
        n = token_adapter_ids.shape[0]
        if n > self.mask.shape[0]:
            raise RuntimeError(f"a step of {n} tokens exceeds the {self.mask.shape[0]} the adapters were sized for")
        self.active = bool(token_adapter_ids.any())
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

    def needed(self) -> bool:
        """Eager steps without adapter tokens skip the update; a graph being captured always includes it."""
        return self.active or (self.cuda and torch.cuda.is_current_stream_capturing())


class MultiLoraLinear(nn.Module):
    """A linear layer plus the low-rank update of each token's adapter. Inputs are tokens x features."""

    def __init__(self, base: nn.Module, slots: LoraSlots, lora_a: torch.Tensor, lora_b: torch.Tensor, num_slices: int):
        super().__init__()
        self.base, self.slots, self.num_slices = base, slots, num_slices
        self.register_buffer("lora_a", lora_a, persistent=False)  # [S*K*R, in]
        self.register_buffer("lora_b", lora_b, persistent=False)  # [out, S*K*R]
        self.reduce_group = base.group if base.reduces else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.reduce_group
        if group is None:
            y = self.base(x)
            return self._add_update(x, y) if self.slots.needed() else y
        y = self.base.partial(x)  # row parallel: add this shard's partial update before the sum over shards
        if self.slots.needed():
            y = self._add_update(x, y)
        return group.all_reduce(y)

    def _add_update(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        h = F.linear(x, self.lora_a).view(n, self.num_slices, -1)
        h = (h * self.slots.mask[:n].unsqueeze(1)).view(n, -1)
        return y.addmm_(h, self.lora_b.t())


def _layer_of(module_name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """The model layer that computes a checkpoint module, and its slice there (q_proj -> qkv_proj, "q")."""
    for source, (fused, shard) in packed.items():
        if module_name.endswith("." + source):
            return module_name[: -len(source)] + fused, shard
    return module_name, None


def _stack(base: LinearBase, parts: dict[tuple[int, Any], tuple[LoraModule, float]], shards: list[Any],
           num_adapters: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's stacked A [S*K*R, in] and scaled B [out, S*K*R] of one layer, in float32."""
    out_local, in_local = base.output_size, base.input_size
    row = base.tp_dim == 1

    def shard_like_weight(full: torch.Tensor, local_shape: tuple[int, int], shard: Any) -> torch.Tensor:
        """This rank's part of `full`, placed where the layer's own loader would put the weight's."""
        local = torch.zeros(local_shape)
        offset, size, part = base.local_part(full, shard, split_dim_only=True)
        local.narrow(0, offset, size).copy_(part)
        return local

    a = torch.zeros(len(shards), num_adapters, rank, in_local)
    b = torch.zeros(out_local, len(shards), num_adapters, rank)
    for (k, shard), (module, scale) in parts.items():
        s, r = shards.index(shard), module.rank
        scaled_b = module.b * module.scaling(scale)
        if row:
            a[s, k, :r] = shard_like_weight(module.a, (r, in_local), shard)
            b[:, s, k, :r] = scaled_b
        else:
            a[s, k, :r] = module.a
            b[:, s, k, :r] = shard_like_weight(scaled_b, (out_local, r), shard)
    return a.reshape(-1, in_local), b.reshape(out_local, -1)


def attach_multi_lora(model: nn.Module, loras: list[tuple[PeftLora, float]], max_tokens: int) -> LoraSlots:
    """Wrap every linear layer any of `loras` (adapter ids 1..K, each with its scale) adapts."""
    packed = getattr(model, "packed_modules_mapping", {})
    targets: dict[str, dict[tuple[int, Any], tuple[LoraModule, float]]] = {}
    for k, (lora, scale) in enumerate(loras):
        for name, module in lora.modules.items():
            path, shard = _layer_of(name, packed)
            targets.setdefault(path, {})[(k, shard)] = (module, scale)
    rank = max(m.rank for lora, _ in loras for m in lora.modules.values())
    weight = next(model.parameters())
    slots = LoraSlots(len(loras), rank, weight.dtype, weight.device, max_tokens)
    for path, parts in targets.items():
        base = model.get_submodule(path)
        if not isinstance(base, LinearBase):
            raise AdapterError(
                f"per-request LoRA adapts linear projections only, not {path} ({type(base).__name__}); "
                "merge this adapter instead (merge=True)"
            )
        fused = path.rpartition(".")[2]
        shards = [shard for fused_name, shard in packed.values() if fused_name == fused] or [None]
        a, b = _stack(base, parts, shards, len(loras), rank)
        wrapped = MultiLoraLinear(base, slots, a.to(base.weight.device, base.weight.dtype),
                                  b.to(base.weight.device, base.weight.dtype), len(shards))
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, wrapped)
    return slots
