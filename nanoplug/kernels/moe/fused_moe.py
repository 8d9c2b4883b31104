"""The experts of an MoE layer on CUDA in the manner of vLLM's and SGLang's `fused_moe`: the (token, slot) pairs
sorted by expert and padded per expert to the GEMM's block of rows (`align_block_size`), then one grouped GEMM
launch per projection, each program multiplying one block of rows by one expert's weight.

gate_up: x[pair // k] @ w13[e].T -> [T*k, 2I]; SiLU-and-mul -> [T*k, I]; down: @ w2[e].T times the routing
weight -> [T*k, H]; the k rows of a token summed. The launch grids are sized from T*k and the number of experts
alone (blocks past the padded count exit at once), so a step needs no host sync and CUDA graphs capture it.
Block sizes come from `configs/` (per expert count, intermediate size and GPU, by batch size; written by
benchmarks/gpu_moe.py --tune). On a CPU the kernel runs only under TRITON_INTERPRET=1 (the tests).

A decode step of a few tokens (up to GEMV_TOKENS; FP8_GEMV_TOKENS for e4m3 experts) takes two GEMV launches
instead (`experts_gemv`): no sort, no
padding to a block of rows, the SiLU-and-mul inside the first and the sum over a token's k experts inside the
second. There each pair reads its expert's rows once either way, and the sort and the other small launches around
the GEMMs cost more than the products (24 layers of them in a batch-1 step of the 30B-A3B shape).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoplug.api import import_triton, interpreting

triton, tl, TRITON_ERROR = import_triton()
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
SMALL_BATCH_CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4,
                          num_stages=3)
GEMV_TOKENS = 4  # up to this many tokens a step, the two GEMV launches (experts_gemv)
# the GEMVs' rows per program (gate_up: that many gate rows and their up rows; down: output rows over k experts),
# K step and warps
GEMV_CONFIG = dict(UP_BLOCK_N=8, UP_BLOCK_K=128, DOWN_BLOCK_N=4, DOWN_BLOCK_K=128, num_warps=8)
# e4m3 experts (a byte a weight) take a longer K step to fill a load, and the GEMVs stay ahead of the grouped GEMM
# up to 8 tokens: the fastest of `benchmarks/gpu_moe.py --sweep-gemv --fp8` on an H100 (benchmarks/RESULTS.md), by
# tokens (1; 2 and more)
FP8_GEMV_CONFIG = {1: dict(UP_BLOCK_N=16, UP_BLOCK_K=256, DOWN_BLOCK_N=8, DOWN_BLOCK_K=128, num_warps=8),
                   2: dict(UP_BLOCK_N=16, UP_BLOCK_K=512, DOWN_BLOCK_N=8, DOWN_BLOCK_K=128, num_warps=8)}
FP8_GEMV_TOKENS = 8

if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                             scale_ptr, N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm, stride_se,
                             A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                             SCALED: tl.constexpr,
                             BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                             GROUP_SIZE_M: tl.constexpr, NUM_BLOCKS_M):
        """C[pair] = A[pair // A_ROW_DIV] @ B[expert].T (times the pair's routing weight) for one block of
        BLOCK_SIZE_M sorted pairs, all of one expert, and BLOCK_SIZE_N output columns. SCALED: B holds quantized
        values (fp8, exact in A's dtype) and each output column is multiplied by its row's scale after the sum."""
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
        in_group = GROUP_SIZE_M * num_pid_n  # blocks of rows side by side reuse each weight tile from L2
        first_m = (pid // in_group) * GROUP_SIZE_M
        group_m = min(NUM_BLOCKS_M - first_m, GROUP_SIZE_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        if pid_m * BLOCK_SIZE_M >= tl.load(num_padded_ptr):
            return
        rows = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
        pairs = tl.load(sorted_ids_ptr + rows)
        row_ok = pairs < num_pairs  # padding pairs hold num_pairs
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        rn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + rk[None, :]
        b_ptrs = b_ptr + expert * stride_be + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_SIZE_K):
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if SCALED:
                b = b.to(a.dtype)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
            a_ptrs += BLOCK_SIZE_K
            b_ptrs += BLOCK_SIZE_K
        if SCALED:
            acc *= tl.load(scale_ptr + expert * stride_se + rn, mask=n_ok, other=0.0)[None, :]
        if MUL_WEIGHT:
            acc *= tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gate_up_gemv_kernel(x_ptr, w13_ptr, ids_ptr, act_ptr, scale_ptr, K, I, stride_xm, stride_we, stride_wn,
                             stride_am, stride_se, TOP_K: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        """act[pair, n] = silu(gate) * up for BLOCK_N of the pair's expert's gate rows and the matching up rows
        (gate and up each rounded to the activations' dtype first, as the grouped path stores gate_up; SCALED:
        each row's sum times its scale)."""
        pair, pid_n = tl.program_id(0), tl.program_id(1)
        token = pair // TOP_K
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < I
        gate_ptrs = w13_ptr + expert * stride_we + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        up_ptrs = gate_ptrs + I * stride_wn
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            xv = tl.load(x_ptr + token * stride_xm + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
            ok = n_ok[:, None] & k_ok[None, :]
            acc_gate += tl.load(gate_ptrs + k0, mask=ok, other=0.0).to(tl.float32) * xv[None, :]
            acc_up += tl.load(up_ptrs + k0, mask=ok, other=0.0).to(tl.float32) * xv[None, :]
        gate = tl.sum(acc_gate, axis=1)
        up = tl.sum(acc_up, axis=1)
        if SCALED:
            gate *= tl.load(scale_ptr + expert * stride_se + rn, mask=n_ok, other=0.0)
            up *= tl.load(scale_ptr + expert * stride_se + I + rn, mask=n_ok, other=0.0)
        gate = gate.to(act_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(act_ptr.dtype.element_ty).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + pair * stride_am + rn, act.to(act_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_gemv_kernel(act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, scale_ptr, H, I, stride_am, stride_we,
                          stride_wn, stride_om, stride_se, TOP_K: tl.constexpr, SCALED: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[token, n] = sum over the token's k pairs of weight * (w2[expert] @ act[pair])[n] for BLOCK_N rows,
        each pair's row rounded to the output dtype before the sum (as the grouped path's down rows are; SCALED:
        each row's sum times its scale first)."""
        token, pid_n = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < H
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pair = token * TOP_K + j
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            w_ptrs = w2_ptr + expert * stride_we + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                k_ok = rk < I - k0
                a = tl.load(act_ptr + pair * stride_am + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
                acc += tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a[None, :]
            down = tl.sum(acc, axis=1)
            if SCALED:
                down *= tl.load(scale_ptr + expert * stride_se + rn, mask=n_ok, other=0.0)
            down *= tl.load(weights_ptr + pair).to(tl.float32)
            total += down.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + token * stride_om + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size in torch ops, without a host sync: (sorted_ids, expert_ids, num_padded).

    sorted_ids [capacity]: the flat (token * k + slot) pairs grouped by expert, each expert's run padded to a
    multiple of `block_m` with the value T*k; expert_ids [capacity / block_m]: the expert of each block;
    num_padded [1]: how many entries are real or padding (the blocks past it are skipped). Capacity is the most
    any routing can need: T*k + min(T*k, E) * (block_m - 1), rounded up to a block."""
    flat = topk_ids.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)  # bincount would sync (its size)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts]
    capacity = -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@functools.lru_cache(maxsize=None)
def _configs(num_experts: int, intermediate: int, device_name: str) -> dict[int, dict] | None:
    name = f"E={num_experts},N={intermediate},device_name={device_name.replace(' ', '_')}.json"
    file = CONFIG_DIR / name
    if not file.is_file():
        return None
    return {int(m): cfg for m, cfg in json.loads(file.read_text()).items()}


@functools.lru_cache(maxsize=None)
def _device_name(kind: str, index: int | None) -> str:
    return torch.cuda.get_device_name(index) if kind == "cuda" else "cpu"


def config_for(num_tokens: int, num_experts: int, intermediate: int, device: torch.device) -> dict:
    """The tuned block sizes for this batch (the nearest batch size in the GPU's file), else a default."""
    table = _configs(num_experts, intermediate, _device_name(device.type, device.index))
    if table:
        return table[min(table, key=lambda m: abs(m - num_tokens))]
    return SMALL_BATCH_CONFIG if num_tokens <= 32 else DEFAULT_CONFIG


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor, sorted_ids, expert_ids,
          num_padded, row_div: int, mul_weight: bool, cfg: dict, scale: torch.Tensor | None = None) -> None:
    n, k = b.shape[1], b.shape[2]
    bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
    blocks_m = sorted_ids.numel() // bm
    grid = (blocks_m * triton.cdiv(n, bn),)
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_padded, weights if scale is None else scale, n, k,
        weights.numel(), a.stride(0), b.stride(0), b.stride(1), c.stride(0), 0 if scale is None else scale.stride(0),
        A_ROW_DIV=row_div, MUL_WEIGHT=mul_weight, IEEE=a.dtype == torch.float32, SCALED=scale is not None,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], GROUP_SIZE_M=cfg["GROUP_SIZE_M"],
        NUM_BLOCKS_M=blocks_m, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


QUANTIZED = tuple(filter(None, (getattr(torch, "float8_e4m3fn", None),)))  # per-row scaled experts' value types


def takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales=None) -> bool:
    """Whether the kernel runs these experts: CUDA tensors (or the interpreter), contiguous weights of the
    activations' dtype, or of a QUANTIZED type with contiguous float32 scales."""
    if scales is None:
        weights_ok = x.dtype == w13.dtype == w2.dtype
    else:
        weights_ok = (w13.dtype in QUANTIZED and w2.dtype in QUANTIZED
                      and all(s.dtype == torch.float32 and s.is_contiguous() for s in scales))
    return (triton is not None and (x.device.type == "cuda" or interpreting()) and x.dim() == 2 and weights_ok
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and w13.is_contiguous() and w2.is_contiguous())


def experts_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, config: dict | None = None, scales=None) -> torch.Tensor:
    """`fused_experts` for a few tokens: gate_up with the SiLU-and-mul, then down with the weighted sum over each
    token's k experts, one launch each (config: GEMV_CONFIG's keys)."""
    t, k = topk_ids.shape
    cfg = config or (GEMV_CONFIG if scales is None else FP8_GEMV_CONFIG[min(t, 2)])
    x = x.contiguous()
    _, two_i, hidden = w13.shape
    inter = two_i // 2
    ids = topk_ids.flatten().contiguous()
    weights = topk_weights.flatten().contiguous()
    s13, s2 = scales if scales is not None else (weights, weights)  # (a pointer the kernels do not read)
    scaled = scales is not None
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    _gate_up_gemv_kernel[(t * k, triton.cdiv(inter, cfg["UP_BLOCK_N"]))](
        x, w13, ids, act, s13, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        s13.stride(0) if scaled else 0, TOP_K=k, SCALED=scaled, BLOCK_N=cfg["UP_BLOCK_N"],
        BLOCK_K=cfg["UP_BLOCK_K"], num_warps=cfg["num_warps"])
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    _down_gemv_kernel[(t, triton.cdiv(hidden, cfg["DOWN_BLOCK_N"]))](
        act, w2, ids, weights, out, s2, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        s2.stride(0) if scaled else 0, TOP_K=k, SCALED=scaled, BLOCK_N=cfg["DOWN_BLOCK_N"],
        BLOCK_K=cfg["DOWN_BLOCK_K"], num_warps=cfg["num_warps"])
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, silu_and_mul=None, config: dict | None = None, scales=None
                  ) -> torch.Tensor:
    """sum_k topk_weights[t, k] * MLP_{topk_ids[t, k]}(x[t]), the signature of `experts_plain`: two grouped GEMM
    launches (gate_up, down) and the SiLU-and-mul between them; up to GEMV_TOKENS tokens, `experts_gemv`
    (unless a grouped GEMM config is given). `scales`: per-row scales of quantized (fp8) experts."""
    from nanoplug.api.layers import experts_batched

    if not takes(x, w13, w2, scales):
        return experts_batched(x, w13, w2, topk_weights, topk_ids, scales=scales)
    t, k = topk_ids.shape
    if config is None and t <= (GEMV_TOKENS if scales is None else FP8_GEMV_TOKENS):
        return experts_gemv(x, w13, w2, topk_weights, topk_ids, scales=scales)
    x = x.contiguous()
    num_experts, two_i, hidden = w13.shape
    cfg = config or config_for(t, num_experts, two_i // 2, x.device)
    sorted_ids, expert_ids, num_padded = align_block_size(topk_ids, num_experts, cfg["BLOCK_SIZE_M"])
    weights = topk_weights.flatten().contiguous()
    gate_up = torch.empty(t * k, two_i, dtype=x.dtype, device=x.device)
    s13, s2 = scales if scales is not None else (None, None)
    _gemm(x, w13, gate_up, weights, sorted_ids, expert_ids, num_padded, k, False, cfg, s13)
    if silu_and_mul is None:
        g, u = gate_up.chunk(2, dim=-1)
        act = F.silu(g) * u
    else:
        act = silu_and_mul(gate_up)
    down = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, w2, down, weights, sorted_ids, expert_ids, num_padded, 1, True, cfg, s2)
    return down.view(t, k, hidden).sum(1)
