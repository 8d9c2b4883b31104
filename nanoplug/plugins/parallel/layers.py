"""Linear, embedding and LM-head layers sharded over a process group (one rank: no sharding).

Model plugins build their layers through `Layers(group)`, so `single` and `tensor` swap by name.
Each parameter carries a `weight_loader(param, tensor, shard_id=None)` that takes the full
checkpoint tensor and keeps this rank's shard, packing q/k/v and gate/up where the model fuses them.
Every loader checks the full tensor's shape before it narrows or copies (core/loader.py's
check_shape), so a checkpoint that does not fit the config is an error, never a silent cut or broadcast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.core.errors import ModelLoadError
from nanoplug.core.interfaces import ProcessGroup
from nanoplug.core.loader import check_shape, copy_weight
from nanoplug.core.packed_linear import linear


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


def _plain_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    copy_weight(param.data, tensor)


class LinearBase(nn.Module):
    packed: torch.Tensor | None = None  # the weight packed for MKL on the CPU (core/packed_linear.py)

    def __init__(self, group: ProcessGroup, in_features: int, out_features: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.group, self.tp_dim = group, tp_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full `tensor`, whose shape must be this rank's times the world size."""
        if self.tp_dim is None or self.group.world_size == 1:
            check_shape(tensor, param.shape)
            return tensor
        full = list(param.shape)
        full[self.tp_dim] *= self.group.world_size
        check_shape(tensor, full, f"split over {self.group.world_size} ranks along dim {self.tp_dim}")
        size = param.shape[self.tp_dim]
        return tensor.narrow(self.tp_dim, self.group.rank * size, size)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, self._shard(param, tensor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class ReplicatedLinear(LinearBase):
    def __init__(self, group, in_features, out_features, bias=False):
        super().__init__(group, in_features, out_features, bias, None)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank's output is its slice."""

    def __init__(self, group, in_features, out_features, bias=False):
        super().__init__(group, in_features, _divide(out_features, group.world_size, "output features"), bias, 0)

    def _load_fused(self, param, tensor) -> None:
        """A tensor already fused in the checkpoint (qkv_proj, gate_up_proj): whole on one rank only,
        since each rank's slice must take rows from every part."""
        if self.group.world_size > 1:
            raise ModelLoadError(
                f"an already fused {type(self).__name__} tensor cannot be split over {self.group.world_size} ranks "
                "(each rank needs rows of every part); save the checkpoint with its parts unfused (q/k/v_proj, "
                "gate/up_proj) or run it on one device"
            )
        ColumnParallelLinear.weight_loader(self, param, tensor)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate and up)."""

    def __init__(self, group, in_features, output_sizes: list[int], bias=False):
        for size in output_sizes:  # each part is split on its own, so each must divide (not just the sum)
            _divide(size, group.world_size, "output features of each fused projection")
        self.output_sizes = output_sizes
        super().__init__(group, in_features, sum(output_sizes), bias)

    def weight_loader(self, param, tensor, shard_id=None) -> None:
        if shard_id is None:
            return self._load_fused(param, tensor)
        ws = self.group.world_size
        offset = sum(self.output_sizes[:shard_id]) // ws
        size = self.output_sizes[shard_id] // ws
        check_shape(tensor, [self.output_sizes[shard_id], *param.shape[1:]],
                    f"part {shard_id} of the {len(self.output_sizes)} fused projections")
        copy_weight(param.data.narrow(0, offset, size), tensor.narrow(0, self.group.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused, heads split over ranks."""

    def __init__(self, group, hidden_size, head_dim, num_heads, num_kv_heads, bias=False):
        ws = group.world_size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, ws, "attention heads")
        self.num_kv_heads = _divide(num_kv_heads, ws, "KV heads")
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(group, hidden_size, out, bias)

    def weight_loader(self, param, tensor, shard_id=None) -> None:
        if shard_id is None:
            return self._load_fused(param, tensor)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        ws, heads = self.group.world_size, "num_attention_heads" if shard_id == "q" else "num_key_value_heads"
        check_shape(tensor, [size * ws, *param.shape[1:]],
                    f"{heads} {size * ws // self.head_dim} x head_dim {self.head_dim} rows")
        copy_weight(param.data.narrow(0, offset, size), tensor.narrow(0, self.group.rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, group, in_features, out_features, bias=False):
        super().__init__(group, _divide(in_features, group.world_size, "input features"), out_features, bias, 1)

    def weight_loader(self, param, tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            copy_weight(param.data, tensor)
        else:
            super().weight_loader(param, tensor)

    def forward(self, x):
        y = linear(x, self.weight, self.bias if self.group.rank == 0 else None, self.packed)
        return self.group.all_reduce(y) if self.group.world_size > 1 else y


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over ranks; each rank embeds its ids, the all-reduce fills the rest."""

    def __init__(self, group, vocab_size: int, hidden_size: int):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + group.world_size - 1) // group.world_size
        self.start = group.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, tensor, shard_id=None) -> None:
        check_shape(tensor, [self.vocab_size, param.shape[1]], "vocab_size x hidden_size of config.json")
        rows = tensor[self.start:self.start + self.per_rank]
        param.data.zero_()
        copy_weight(param.data[: rows.shape[0]], rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary split over ranks; logits gathered on every rank."""

    packed: torch.Tensor | None = None  # as LinearBase.packed

    def __init__(self, group, vocab_size: int, hidden_size: int, bias: bool = False):
        super().__init__(group, vocab_size, hidden_size)
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed)
        if self.group.world_size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]


class Layers:
    """The layer factory a model plugin receives: every layer bound to one process group."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def replicated(self, in_features, out_features, bias=False):
        return ReplicatedLinear(self.group, in_features, out_features, bias)

    def column(self, in_features, out_features, bias=False):
        return ColumnParallelLinear(self.group, in_features, out_features, bias)

    def merged_column(self, in_features, output_sizes, bias=False):
        return MergedColumnParallelLinear(self.group, in_features, output_sizes, bias)

    def qkv(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False):
        return QKVParallelLinear(self.group, hidden_size, head_dim, num_heads, num_kv_heads, bias)

    def row(self, in_features, out_features, bias=False):
        return RowParallelLinear(self.group, in_features, out_features, bias)

    def embedding(self, vocab_size, hidden_size):
        return VocabParallelEmbedding(self.group, vocab_size, hidden_size)

    def lm_head(self, vocab_size, hidden_size):
        return ParallelLMHead(self.group, vocab_size, hidden_size)
