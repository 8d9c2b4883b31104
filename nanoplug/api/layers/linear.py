"""Linear layers sharded over a process group (one rank: no sharding), their weights held by a LinearMethod.

Each parameter the method creates carries `weight_loader(param, tensor, shard_id=None)`: it takes the
full checkpoint tensor, keeps this rank's part (`local_part`), and hands it to the method, which
checks its shape and stores it in its format. q/k/v and gate/up are fused into one layer each, their
checkpoint tensors loaded as parts (`shard_id`) of it.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from nanoplug.api.linear import LinearMethod, check_shape


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class LinearBase(nn.Module):
    """One linear layer of the library.

    `tp_dim` says how it is sharded: 0 splits the output features over the ranks (column parallel),
    1 the input features (row parallel: each rank's partial products are summed), None keeps it whole.
    `input_size`/`output_size` are this rank's. Per-request adapters rely on `group`, `tp_dim`,
    `local_part` and `partial`; nothing else about a layer is promised."""

    role: ClassVar[str] = "linear"  # "linear" | "embedding" | "lm_head": what a LinearMethod is asked to serve

    def __init__(self, group: Any, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 linear_method: LinearMethod):
        super().__init__()
        self.group, self.tp_dim = group, tp_dim
        self.input_size, self.output_size = input_size, output_size
        self.linear_method = linear_method
        linear_method.create_weights(self, input_size, output_size, torch.get_default_dtype())
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._apply_method = linear_method.apply

    @property
    def reduces(self) -> bool:
        """Whether its output is a partial sum that an all-reduce over the group completes."""
        return self.tp_dim == 1 and self.group.world_size > 1

    def _part(self, tensor: torch.Tensor, dim: int, local: int, what: str) -> torch.Tensor:
        """This rank's `local` rows (dim 0) or columns (dim 1) of a full tensor, whose size must be ws * local."""
        ws = self.group.world_size
        if tensor.dim() <= dim or tensor.shape[dim] != local * ws:
            raise ValueError(f"{type(self).__name__} expects {what} of {local * ws} along dim {dim} "
                             f"(split over {ws} rank(s)), found a tensor of shape {list(tensor.shape)}")
        return tensor if ws == 1 else tensor.narrow(dim, self.group.rank * local, local)

    def local_part(self, tensor: torch.Tensor, shard_id: Any = None) -> tuple[int, int, torch.Tensor]:
        """This rank's part of a full checkpoint tensor of this layer (or of its part `shard_id`): the
        output rows it fills (offset, count) and the narrowed tensor."""
        if self.tp_dim == 0:
            part = self._part(tensor, 0, self.output_size, "output features")
        elif self.tp_dim == 1 and tensor.dim() > 1:
            part = self._part(tensor, 1, self.input_size, "input features")
        else:
            part = tensor  # replicated, or a row-parallel layer's bias (added once, after the sum)
        return 0, part.shape[0], part

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        offset, size, part = self.local_part(tensor, shard_id)
        if param is self.bias:
            dst = param.data.narrow(0, offset, size)
            check_shape(self, dst.shape, part.shape)
            dst.copy_(part)
        else:
            self.linear_method.load(self, param, part, offset, size)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product (the bias on rank 0 only), before any all-reduce."""
        return self._apply_method(self, x, self.bias if self.group.rank == 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_method(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, group, in_features, out_features, bias=False, linear_method=None):
        super().__init__(group, in_features, out_features, bias, None, linear_method)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank's output is its slice."""

    def __init__(self, group, in_features, out_features, bias=False, linear_method=None):
        super().__init__(group, in_features, divide(out_features, group.world_size, "output features"), bias, 0,
                         linear_method)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate and up)."""

    def __init__(self, group, in_features, output_sizes: list[int], bias=False, linear_method=None):
        for size in output_sizes:  # each part is split on its own, so each must divide (not just the sum)
            divide(size, group.world_size, "output features of each fused projection")
        self.output_sizes = output_sizes
        super().__init__(group, in_features, sum(output_sizes), bias, linear_method)

    def local_part(self, tensor, shard_id=None):
        if shard_id is None:
            return super().local_part(tensor)
        ws = self.group.world_size
        size = self.output_sizes[shard_id] // ws
        return sum(self.output_sizes[:shard_id]) // ws, size, self._part(tensor, 0, size, f"part {shard_id}'s rows")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused, heads split over ranks."""

    def __init__(self, group, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, linear_method=None):
        ws = group.world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, ws, "attention heads")
        self.num_kv_heads = divide(num_kv_heads, ws, "KV heads")
        super().__init__(group, hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, linear_method)

    def local_part(self, tensor, shard_id=None):
        if shard_id is None:
            return super().local_part(tensor)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        return offset, size, self._part(tensor, 0, size, f"{shard_id} rows")


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, group, in_features, out_features, bias=False, linear_method=None):
        super().__init__(group, divide(in_features, group.world_size, "input features"), out_features, bias, 1,
                         linear_method)

    def forward(self, x):
        y = self._apply_method(self, x, self.bias if self.group.rank == 0 else None)
        return self.group.all_reduce(y) if self.group.world_size > 1 else y
