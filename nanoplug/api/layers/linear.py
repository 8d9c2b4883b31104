"""Linear layers sharded over a process group (one rank: no sharding), their weights held by a LinearMethod.

Each parameter the method creates carries `weight_loader(param, tensor, shard_id=None)`: it takes the
full checkpoint tensor, checks its whole shape against what the config builds, keeps this rank's part
(`local_part`), and hands it to the method, which stores it in its format. q/k/v and gate/up are fused
into one layer each, their checkpoint tensors loaded as parts (`shard_id`) of it. A tensor that does
not fit is an error before anything is written, never a silent cut (`narrow`) or broadcast (`copy_`).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from nanoplug.api.errors import ModelLoadError
from nanoplug.api.linear import LinearMethod, check_shape, copy_weight


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

    def _split(self, tensor: torch.Tensor, rows: int, what: str = "", split_dim_only: bool = False) -> torch.Tensor:
        """This rank's part of a full tensor of `rows` output rows (a weight [rows, input], or a bias [rows]),
        checked whole first: column parallel splits the rows, row parallel the input columns of a weight.
        `split_dim_only`: check only the dimension that is split (a low-rank factor's other one is its rank)."""
        ws, is_bias = self.group.world_size, tensor.dim() == 1
        if is_bias:
            expected = [rows * ws if self.tp_dim == 0 else rows]
        else:
            expected = [rows * ws if self.tp_dim == 0 else rows, self.input_size * (ws if self.tp_dim == 1 else 1)]
        if split_dim_only:
            dim = 1 if self.tp_dim == 1 and not is_bias else 0
            expected = [expected[dim] if d == dim else n for d, n in enumerate(tensor.shape)] if tensor.dim() > dim \
                else expected
        if ws > 1 and self.tp_dim is not None and not (is_bias and self.tp_dim == 1):
            what = ", ".join(filter(None, [what, f"split over {ws} ranks along dim {self.tp_dim}"]))
        check_shape(tensor, expected, what)
        if ws == 1 or self.tp_dim is None or (is_bias and self.tp_dim == 1):
            return tensor  # whole: one rank, replicated, or a row-parallel layer's bias (added once, after the sum)
        if self.tp_dim == 0:
            return tensor.narrow(0, self.group.rank * rows, rows)
        return tensor.narrow(1, self.group.rank * self.input_size, self.input_size)

    def local_part(self, tensor: torch.Tensor, shard_id: Any = None,
                   split_dim_only: bool = False) -> tuple[int, int, torch.Tensor]:
        """This rank's part of a full checkpoint tensor of this layer (or of its part `shard_id`), its
        shape checked first: the output rows it fills (offset, count) and the narrowed tensor.
        `split_dim_only`: the tensor is sharded like the weight but only the split dimension is the
        weight's (a LoRA factor: B [rows, rank] of a column-parallel layer, A [rank, input] of a row-parallel one)."""
        part = self._split(tensor, self.output_size, split_dim_only=split_dim_only)
        return 0, part.shape[0], part

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        offset, size, part = self.local_part(tensor, shard_id)
        if param is self.bias:
            copy_weight(param.data.narrow(0, offset, size), part, type(self).__name__)
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

    def _fused_whole(self, tensor: torch.Tensor, split_dim_only: bool = False) -> tuple[int, int, torch.Tensor]:
        """A tensor already fused in the checkpoint (qkv_proj, gate_up_proj): whole on one rank only,
        since each rank's slice must take rows from every part."""
        if self.group.world_size > 1:
            raise ModelLoadError(
                f"an already fused {type(self).__name__} tensor cannot be split over {self.group.world_size} ranks "
                "(each rank needs rows of every part); save the checkpoint with its parts unfused (q/k/v_proj, "
                "gate/up_proj) or run it on one device"
            )
        return LinearBase.local_part(self, tensor, split_dim_only=split_dim_only)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate and up)."""

    def __init__(self, group, in_features, output_sizes: list[int], bias=False, linear_method=None):
        for size in output_sizes:  # each part is split on its own, so each must divide (not just the sum)
            divide(size, group.world_size, "output features of each fused projection")
        self.output_sizes = output_sizes
        super().__init__(group, in_features, sum(output_sizes), bias, linear_method)

    def local_part(self, tensor, shard_id=None, split_dim_only=False):
        if shard_id is None:
            return self._fused_whole(tensor, split_dim_only)
        ws = self.group.world_size
        size = self.output_sizes[shard_id] // ws
        part = self._split(tensor, size, f"part {shard_id} of the {len(self.output_sizes)} fused projections",
                           split_dim_only)
        return sum(self.output_sizes[:shard_id]) // ws, size, part


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused, heads split over ranks."""

    def __init__(self, group, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, linear_method=None):
        ws = group.world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, ws, "attention heads")
        self.num_kv_heads = divide(num_kv_heads, ws, "KV heads")
        super().__init__(group, hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, linear_method)

    def local_part(self, tensor, shard_id=None, split_dim_only=False):
        if shard_id is None:
            return self._fused_whole(tensor, split_dim_only)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        heads = "num_attention_heads" if shard_id == "q" else "num_key_value_heads"
        ws = self.group.world_size
        part = self._split(tensor, size, f"{heads} {size * ws // self.head_dim} x head_dim {self.head_dim} rows",
                           split_dim_only)
        return offset, size, part


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, group, in_features, out_features, bias=False, linear_method=None):
        super().__init__(group, divide(in_features, group.world_size, "input features"), out_features, bias, 1,
                         linear_method)

    def forward(self, x):
        y = self._apply_method(self, x, self.bias if self.group.rank == 0 else None)
        return self.group.all_reduce(y) if self.group.world_size > 1 else y
