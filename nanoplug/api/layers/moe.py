"""Mixture-of-experts layers: the router's top-k, the experts' weights, and the plain and batched ways to run them.

Every expert is a SwiGLU MLP; their weights live stacked, one tensor per projection (`gate_up_proj.weight`
[E, 2I, H], `down_proj.weight` [E, H, I]), so a fused kernel runs each projection for all experts in one
launch. Tensor parallelism shards every expert as the dense MLP is sharded (gate and up by output rows,
down by input columns, one all-reduce after). A platform puts its fused kernel in through
`install_fused_ops` (`FusedOps.moe`, same signature as `fused_experts`). A format that quantizes per output row
(fp8: `LinearMethod.expert_rows`) keeps the stacked layout, values and one float32 scale per expert and row, which
every path takes as `scales=(gate_up, down)`. A format with kernels of its own for stacked experts (GGUF under
Triton: `LinearMethod.stacked_experts`) keeps them in its blocks (`StackedExperts`), on one rank. Experts kept in a
weight format whose kernels are 2-D (GGUF on the CPU: `LinearMethod.keeps_experts`) are instead a layer of it per
expert and projection (`ExpertLayers`), on one rank.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoplug.api.errors import ModelLoadError
from nanoplug.api.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from nanoplug.api.linear import DenseLinearMethod, ExpertRows, LinearMethod, check_shape

Scales = tuple[torch.Tensor, torch.Tensor] | None  # per-row scales of (gate_up, down): [E, 2I] and [E, H] float32


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights as transformers' routers compute them (Qwen2/3-MoE,
    Mixtral): softmax over all experts in float32, the top k, divided by their sum when `renormalize`
    (Mixtral always; Qwen `norm_topk_prob`). Weights float32 [T, k], ids int64 [T, k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the flattened (token, slot) pairs in order of their expert, stable, and how many each
    expert got."""
    flat = topk_ids.flatten()
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Experts' weights [E, rows, cols] (or a selection of them) in `dtype`: values times their row's scale."""
    if scale is None:
        return w
    return (w.float() * scale[..., None]).to(dtype)


def experts_plain(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, scales: Scales = None) -> torch.Tensor:
    """The reference: for each expert that any token chose, its tokens' rows through its MLP, weighted and summed
    back (the way transformers' eager experts do it); quantized experts dequantized first."""
    if scales is not None:
        w13, w2 = (dequantize_experts(w, s, x.dtype) for w, s in zip((w13, w2), scales))
    return experts_each(x, lambda e, h: F.linear(h, w13[e]), lambda e, h: F.linear(h, w2[e]), w13.shape[0],
                        topk_weights, topk_ids)


def experts_each(x: torch.Tensor, gate_up: Callable[[int, torch.Tensor], torch.Tensor],
                 down: Callable[[int, torch.Tensor], torch.Tensor], num_experts: int, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """Each chosen expert in turn: `gate_up(e, rows)` and `down(e, rows)` are its projections (experts kept in a
    weight format are 2-D layers, one call each for the tokens that chose it)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # the experts are chosen on the host (below): refused before that sync, the capture fails cleanly and
        # decode runs eager
        raise RuntimeError("experts run a layer each are chosen on the host, which a CUDA graph cannot hold")
    out = torch.zeros_like(x)
    k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, num_experts)
    # the chosen experts by nonzero, a data-dependent op the CPU's decode recorder sees (such a step then runs eager);
    # a bare tolist() would not be seen, and a recording would replay its own choice of experts
    hit = torch.nonzero(counts).flatten()
    starts = torch.cumsum(counts, 0) - counts
    for e, start, n in zip(hit.tolist(), starts[hit].tolist(), counts[hit].tolist()):
        pairs = order[start:start + n]
        tokens = pairs // k
        gate, up = gate_up(e, x[tokens]).chunk(2, dim=-1)
        y = down(e, F.silu(gate) * up) * topk_weights.flatten()[pairs, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


def experts_batched(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, scales: Scales = None) -> torch.Tensor:
    """The CPU path: tokens sorted by expert into one padded batch per chosen expert, then one batched matmul per
    projection (`torch.bmm` over the experts any token chose; the others' weights are not read, quantized ones
    are dequantized as read)."""
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    hit = torch.nonzero(counts).flatten()
    hit_counts = counts[hit]
    width = int(hit_counts.max())
    starts = torch.cumsum(hit_counts, 0) - hit_counts
    rank_of = torch.arange(order.numel(), device=x.device) - torch.repeat_interleave(starts, hit_counts)
    slot = torch.repeat_interleave(torch.arange(hit.numel(), device=x.device), hit_counts) * width + rank_of
    rows = torch.zeros(hit.numel() * width, x.shape[1], dtype=x.dtype, device=x.device)
    rows[slot] = x[order // k]
    s13, s2 = scales if scales is not None else (None, None)
    w13_hit = dequantize_experts(w13[hit], None if s13 is None else s13[hit], x.dtype)
    w2_hit = dequantize_experts(w2[hit], None if s2 is None else s2[hit], x.dtype)
    h = torch.bmm(rows.view(hit.numel(), width, -1), w13_hit.transpose(1, 2))
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2_hit.transpose(1, 2)).flatten(0, 1)[slot]
    y = y * topk_weights.flatten()[order, None]
    out = torch.zeros(t * k, x.shape[1], dtype=y.dtype, device=x.device)
    out[order] = y
    return out.view(t, k, -1).sum(1).to(x.dtype)


def expert_shard(shard_id: Any, whole: Any) -> tuple[int, Any]:
    """(expert, part) of a checkpoint tensor of one expert (`whole`: the part of a tensor not split in parts); a
    tensor of every expert at once is refused."""
    if shard_id is None:
        raise ModelLoadError("experts' weights are loaded one expert at a time (experts.N.gate_proj/up_proj/"
                             "down_proj); a checkpoint with them already stacked is not supported yet")
    return shard_id if isinstance(shard_id, tuple) else (shard_id, whole)


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: `weight` [E, rows, cols] of this rank. Checkpoints hold one tensor
    per expert (and per part: gate and up are the two halves of `gate_up_proj`); each is checked whole, then this
    rank's rows (`tp_dim` 0) or columns (1) are kept. With `quantized` (ExpertRows) each whole tensor is quantized
    first, so every rank holds the scales one process would (`weight_scale` [E, rows], float32)."""

    def __init__(self, group: Any, num_experts: int, rows: int, cols: int, parts: int, tp_dim: int,
                 quantized: ExpertRows | None = None):
        super().__init__()
        self.group, self.tp_dim, self.parts, self.quantized = group, tp_dim, parts, quantized
        dtype = None if quantized is None else quantized.dtype
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        scale = None if quantized is None else torch.ones(num_experts, rows, dtype=torch.float32)
        self.register_buffer("weight_scale", scale, persistent=False)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        expert, part = expert_shard(shard_id, 0)
        ws, rank = self.group.world_size, self.group.rank
        _, rows, cols = param.shape
        rows //= self.parts
        full = [rows * ws, cols] if self.tp_dim == 0 else [rows, cols * ws]
        what = f"expert {expert}" + (f", split over {ws} ranks along dim {self.tp_dim}" if ws > 1 else "")
        check_shape(tensor, full, what)
        scale = None
        if self.quantized is not None:
            tensor, scale = self.quantized.quantize(tensor.to(param.device))
        if ws > 1:
            start, size = (rank * rows, rows) if self.tp_dim == 0 else (rank * cols, cols)
            tensor = tensor.narrow(self.tp_dim, start, size)
            if scale is not None and self.tp_dim == 0:
                scale = scale.narrow(0, start, size)
        param.data[expert, part * rows:(part + 1) * rows].copy_(tensor)
        if scale is not None:
            self.weight_scale[expert, part * rows:(part + 1) * rows] = scale


class StackedExperts(nn.Module, ABC):
    """One projection of every expert, stacked in a weight format's blocks and run by its kernels
    (`LinearMethod.stacked_experts`). The checkpoint's per-expert tensors arrive through `weight` as for
    ExpertWeights ((expert, part) shards); the format's `process_after_loading` stacks them. A step of few
    (token, slot) pairs runs `pairs`, each pair reading its expert's blocks; more run the fused or batched path on
    `dense`. Neither needs a host sync, so CUDA graphs capture both."""

    quantized: bool = True  # False: the experts arrived as floats (or in mixed formats) and are held dense

    def __init__(self, num_experts: int, rows: int, cols: int, parts: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.rows, self.cols, self.parts, self.dtype = num_experts, rows, cols, parts, dtype
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.loaded: dict[tuple[int, int], Any] = {}  # (expert, part) -> the checkpoint's tensor, until stacked
        self.pair_limit = num_experts  # the most (token, slot) pairs `pairs` runs (a format may set more)

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        expert, part = expert_shard(shard_id, 0)
        check_shape(tensor, [self.rows // self.parts, self.cols], f"expert {expert}")
        self.loaded[expert, part] = tensor

    def take_loaded(self) -> list[Any]:
        """The loaded tensors in stacking order (expert by expert, its parts in order), handed over once."""
        tensors = [self.loaded[e, p] for e in range(self.num_experts) for p in range(self.parts)]
        self.loaded = {}
        return tensors

    @abstractmethod
    def pairs(self, x: torch.Tensor, ids: torch.Tensor, x_div: int) -> torch.Tensor:
        """[len(ids), rows]: row m is x[m // x_div] times expert ids[m]'s weight, in x's dtype."""

    @abstractmethod
    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight [E, rows, cols] in `dtype` (dequantized into a fresh tensor when quantized)."""


def experts_stacked(x: torch.Tensor, gate_up: StackedExperts, down: StackedExperts, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, run: Callable) -> torch.Tensor:
    """Experts kept stacked in a format's blocks: up to the projections' `pair_limit` (token, slot) pairs each pair
    reads its expert's blocks; more run `run` (fused or batched) on every expert dequantized."""
    t, k = topk_ids.shape
    if not (gate_up.quantized and down.quantized and t * k <= min(gate_up.pair_limit, down.pair_limit)):
        return run(x, gate_up.dense(x.dtype), down.dense(x.dtype), topk_weights, topk_ids)
    ids = topk_ids.flatten()
    gate, up = gate_up.pairs(x, ids, k).chunk(2, dim=-1)
    y = down.pairs(F.silu(gate) * up, ids, 1)
    return (y.float().view(t, k, -1) * topk_weights[..., None]).sum(1).to(x.dtype)


class ExpertLayers(nn.Module):
    """One projection of every expert kept in a weight format (`LinearMethod.keeps_experts`): a 2-D layer of the
    method per expert. The checkpoint's per-expert tensors arrive as parts of `weight` (as for ExpertWeights), an
    empty parameter that routes each to its expert's layer; the layers' own parameters are filled through it."""

    def __init__(self, num_experts: int, make: Callable[[], nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(num_experts))
        for layer in self.layers:
            layer.expert = True  # one of many: a format keeps a single copy of its weights (no second packing)
        for param in self.layers.parameters():
            param.loaded_through = "weight"  # the loader expects these through this module's `weight`
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        expert, part = expert_shard(shard_id, None)  # part: gate 0 / up 1, or none
        layer = self.layers[expert]
        layer.weight_loader(layer.weight, tensor, part)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s projection of `x` (experts_each's `gate_up` / `down`)."""
        return self.layers[expert](x)


class FusedMoE(nn.Module):
    """The experts of one MoE block: `forward(x, topk_weights, topk_ids)` is sum_k w_k * MLP_{id_k}(x) per token.

    The step runs `fused` (a platform's one-launch-per-projection kernel) where installed, else the batched
    matmuls; experts stacked in a format's blocks (`StackedExperts`) run `experts_stacked`; experts kept in a
    weight format as 2-D layers (`ExpertLayers`) run each chosen expert's layers in turn.
    `experts_plain` is the reference all are tested against."""

    fused: Callable | None = None  # set by install_fused_ops (FusedOps.moe)

    def __init__(self, group: Any, num_experts: int, hidden_size: int, intermediate_size: int,
                 linear_method: LinearMethod | None = None):
        super().__init__()
        ws = group.world_size
        self.group, self.num_experts = group, num_experts
        rows_format = None if linear_method is None else linear_method.expert_rows
        if linear_method is not None and ws == 1 and rows_format is None:
            up = linear_method.stacked_experts(num_experts, 2 * intermediate_size, hidden_size, 2,
                                               torch.get_default_dtype())
            if up is not None:
                self.gate_up_proj = up
                self.down_proj = linear_method.stacked_experts(num_experts, hidden_size, intermediate_size, 1,
                                                               torch.get_default_dtype())
                return
        if linear_method is not None and linear_method.keeps_experts and ws == 1 and rows_format is None:
            self.gate_up_proj = ExpertLayers(num_experts, lambda: MergedColumnParallelLinear(
                group, hidden_size, [intermediate_size] * 2, False, linear_method))
            self.down_proj = ExpertLayers(num_experts, lambda: RowParallelLinear(
                group, intermediate_size, hidden_size, False, linear_method))
            return
        # a format whose kernels are 2-D (GGUF) leaves the experts dense: the loader dequantizes them, and says so
        if linear_method is not None and not linear_method.dequantized_experts and rows_format is None \
                and not isinstance(linear_method, DenseLinearMethod):
            if linear_method.keeps_experts:
                raise ModelLoadError(
                    f"the weight format {type(linear_method).__name__} keeps a mixture-of-experts model's experts on "
                    f"one rank only (a layer per expert), not split over {ws}; use tensor_parallel_size=1")
            raise ModelLoadError(
                f"the weight format {type(linear_method).__name__} does not apply to mixture-of-experts weights yet "
                "(experts are kept dense); load this model without a quantized weight format (fp8 on load)")
        if intermediate_size % ws:
            raise ValueError(f"the experts' intermediate size ({intermediate_size}) is not divisible by "
                             f"tensor_parallel_size ({ws})")
        local = intermediate_size // ws
        self.gate_up_proj = ExpertWeights(group, num_experts, 2 * local, hidden_size, 2, 0, rows_format)
        self.down_proj = ExpertWeights(group, num_experts, hidden_size, local, 1, 1, rows_format)

    def partial(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's sum over its slice of every expert's intermediate features, before the all-reduce."""
        if isinstance(self.gate_up_proj, ExpertLayers):
            return experts_each(x, self.gate_up_proj, self.down_proj, self.num_experts, topk_weights, topk_ids)
        run = self.fused or experts_batched
        up, down = self.gate_up_proj, self.down_proj
        if isinstance(up, StackedExperts):
            return experts_stacked(x, up, down, topk_weights, topk_ids, run)
        if up.weight_scale is None:  # (a platform's op written before quantized experts need not take `scales`)
            return run(x, up.weight, down.weight, topk_weights, topk_ids)
        return run(x, up.weight, down.weight, topk_weights, topk_ids, scales=(up.weight_scale, down.weight_scale))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        y = self.partial(x, topk_weights, topk_ids)
        return self.group.all_reduce(y) if self.group.world_size > 1 else y


class SparseMoeBlock(nn.Module):
    """Router, experts and an optional shared expert: the MLP of an MoE decoder layer.

    `gate` ([E, H], replicated) scores the experts, `route` picks `top_k`; Qwen2-MoE's `shared_expert` (a dense
    MLP every token takes) is scaled by sigmoid(`shared_expert_gate`(x)) and added."""

    fused_route = None  # set by install_fused_ops: `route` in one launch (FusedOps.route)

    def __init__(self, layers: Any, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_expert: nn.Module | None = None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                                 f"({num_experts}); use the config.json saved with the weights")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = layers.replicated(hidden_size, num_experts)
        self.experts = layers.experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = layers.replicated(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = (self.fused_route or route)(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
