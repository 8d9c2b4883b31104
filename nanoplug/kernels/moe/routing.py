"""An MoE router's top-k in one launch: the softmax over the experts in float32, the top k, and their
renormalisation, for each token in one Triton program. `route` (nanoplug/api/layers/moe.py) takes four or five
launches for the same (softmax, topk and its sort, sum, divide), each a few microseconds of a batch-1 decode step
that reads its weights in tens of them, 24-48 layers a step. Same signature and outputs as `route`: weights float32
[T, k] in descending order, ids int64 [T, k]; ties go to the lower expert id. On a CPU the kernel runs only under
TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import torch

from nanoplug.api import import_triton, interpreting

triton, tl, TRITON_ERROR = import_triton()

MAX_EXPERTS = 1024  # one program holds a token's scores in registers


def takes(logits: torch.Tensor, top_k: int) -> bool:
    """Whether the kernel routes these scores: a 2-D CUDA tensor (or the interpreter) of a float type, each row
    contiguous, at most MAX_EXPERTS experts."""
    return (triton is not None and (logits.device.type == "cuda" or interpreting()) and logits.dim() == 2
            and logits.stride(1) == 1 and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and 0 < top_k <= logits.shape[1] <= MAX_EXPERTS)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`nanoplug.api.layers.route` in one launch where `takes` allows, else that function."""
    if not takes(logits, top_k):
        from nanoplug.api.layers import route as plain

        return plain(logits, top_k, renormalize)
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                            K_BLOCK=triton.next_power_of_2(top_k), E_BLOCK=triton.next_power_of_2(e),
                            RENORMALIZE=renormalize, num_warps=1 if e <= 256 else 4)
    return weights, ids


if triton is not None:
    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, K_BLOCK: tl.constexpr,
                      E_BLOCK: tl.constexpr, RENORMALIZE: tl.constexpr):
        t = tl.program_id(0)
        re = tl.arange(0, E_BLOCK)
        x = tl.load(logits_ptr + t * stride_t + re, mask=re < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(re < E, p / tl.sum(p, axis=0), -1.0)  # padding below every probability: never chosen
        rk = tl.arange(0, K_BLOCK)
        top_w = tl.zeros((K_BLOCK,), tl.float32)
        top_i = tl.zeros((K_BLOCK,), tl.int64)
        for i in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            at = tl.min(tl.where(p == best, re, E_BLOCK), axis=0)  # the lowest id among equal probabilities
            at = tl.minimum(at, E - 1)  # (NaN scores match nothing: an id in range all the same)
            top_w = tl.where(rk == i, best, top_w)
            top_i = tl.where(rk == i, at.to(tl.int64), top_i)
            p = tl.where(re == at, -2.0, p)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=0)  # (the slots past TOP_K hold 0)
        tl.store(weights_ptr + t * TOP_K + rk, top_w, mask=rk < TOP_K)
        tl.store(ids_ptr + t * TOP_K + rk, top_i, mask=rk < TOP_K)
