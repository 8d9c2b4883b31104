"""Paged decode attention over an fp8 cache: the shipped Triton kernel (triton_decode.py) in several launch
settings, against a variant that loads K/V tiles by TMA (host-side tensor descriptors over the cache's pages),
and FlashAttention-4 over the same cache in bf16; batch 256 of 1-2k-token contexts in the bench model's shape.

Prints time per call, the K/V bytes read per second and the largest difference from the shipped kernel.
usage: python benchmarks/studies/gpu_decode_variants.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _cuda_timing import cuda_ms
from gpu_fp8_kv import DECODE_SHAPE, decode_case
from nanoplug.kernels.attention import triton_decode as td


@triton.jit
def _decode_tma_kernel(q_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr, tables_ptr, seq_lens_ptr, out_ptr, qk_scale,
                       stride_qb, stride_qh, stride_tb, stride_ob, stride_oh,
                       GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_N: tl.constexpr, F8_AS_F16: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    if F8_AS_F16:
        q = q.to(tl.float16)
    qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for tile_start in range(0, seq_len, BLOCK_N):
        page = tl.load(tables_ptr + b * stride_tb + tile_start // PAGE)
        r = page * PAGE + tile_start % PAGE
        k = k_desc.load([r, kvh * HEAD_DIM])
        v = v_desc.load([r, kvh * HEAD_DIM])
        if F8_AS_F16:
            k, v = k.to(tl.float16), v.to(tl.float16)
        s = tl.dot(q, tl.trans(k))
        live = tile_start + offs < seq_len
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
    acc = acc * tl.load(v_scale_ptr)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def tma_decode(q, k_cache, v_cache, tables, lens, scale, k_scale, v_scale, block_n, warps, stages):
    batch, heads, dim = q.shape
    nb, page, kvh, _ = k_cache.shape
    k_desc = TensorDescriptor.from_tensor(k_cache.view(nb * page, kvh * dim), [block_n, dim])
    v_desc = TensorDescriptor.from_tensor(v_cache.view(nb * page, kvh * dim), [block_n, dim])
    out = torch.empty_like(q)
    _decode_tma_kernel[(batch, kvh)](q, k_desc, v_desc, k_scale, v_scale, tables, lens, out, scale * td.LOG2E,
                                     q.stride(0), q.stride(1), tables.stride(0), out.stride(0), out.stride(1),
                                     GROUP=heads // kvh, GROUP_P=16, HEAD_DIM=dim, PAGE=page, BLOCK_N=block_n,
                                     F8_AS_F16=k_cache.element_size() == 1, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    dev = torch.device("cuda")
    kv_heads, dim = DECODE_SHAPE["kv_heads"], DECODE_SHAPE["dim"]
    q, k16, v16, k8, v8, tables, lens = decode_case(**DECODE_SHAPE)
    one = torch.tensor(1.0, device=dev)
    tokens = int(lens.sum())
    scale = dim ** -0.5
    ref = td.paged_decode(q, k8, v8, tables, lens, scale, 1, one, one)

    def report(label, fn, elem_bytes):
        try:
            out = fn()
            diff = (out.float() - ref.float()).abs().max().item()
            ms = cuda_ms(fn, iters=30)
            gbs = 2 * tokens * kv_heads * dim * elem_bytes / ms / 1e6
            print(f"{label:<58} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s  maxdiff {diff:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001  (a setting that does not compile: the next)
            print(f"{label:<58} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)

    for n, w, s in ((64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (32, 4, 4), (256, 8, 3)):
        cfg = td.DecodeConfig(block_n=n, num_warps=w, num_stages=s)
        report(f"shipped fp8 block_n={n} warps={w} stages={s}",
               lambda: td.paged_decode(q, k8, v8, tables, lens, scale, 1, one, one, cfg), 1)
    for n, w, s in ((64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (128, 4, 4), (256, 8, 3)):
        report(f"tma fp8 block_n={n} warps={w} stages={s}",
               lambda: tma_decode(q, k8, v8, tables, lens, scale, one, one, n, w, s), 1)
    for n, w, s in ((64, 4, 3), (128, 8, 3)):
        report(f"tma bf16 block_n={n} warps={w} stages={s}",
               lambda: tma_decode(q, k16, v16, tables, lens, scale, one, one, n, w, s), 2)
    from flash_attn.cute.interface import flash_attn_varlen_func

    report("FlashAttention-4 bf16", lambda: flash_attn_varlen_func(
        q.unsqueeze(1), k16, v16, seqused_k=lens, page_table=tables, softmax_scale=scale, causal=True)[0].squeeze(1), 2)


if __name__ == "__main__":
    main()
