"""Decode attention over an fp8 cache: which way of multiplying is fastest on the GPU. A study behind
triton_decode.py's float8 path, one kernel (no splits, no rotation, whole tiles) with the dots done:

- QK=0 / PV=0: K and V widened to float16 in registers (what the shipped kernel does);
- QK=1: q split into two e4m3 parts (hi + lo/16, per-row scale), two fp8 dots against the raw fp8 K;
- QK=2: q rounded to e4m3 once (one fp8 dot; too coarse: shown for its speed only);
- PV=1: the softmax weights split into two e4m3 parts (times 256), fp8 dots against the raw fp8 V;
- "swap": transposed dots (scores^T = K q^T, out^T = V^T p^T), so the tile is the MMA's M (wgmma-sized).

Batch 256 of 1-2k-token contexts in the bench model's shape; time per call, fp8 K/V bytes per second, and the
largest error against float32 attention on four sequences. Results: benchmarks/RESULTS.md (session 14).
usage: cd benchmarks && python3 gpu_fp8_decode_dots.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _cuda_timing import cuda_ms
from gpu_fp8_kv import DECODE_SHAPE, decode_case
from nanoplug.kernels.attention import triton_decode as td


@triton.jit
def _e4m3_parts(x, AXIS: tl.constexpr):
    """x (float32) ~ (hi + lo / 16) * scale, hi and lo e4m3, one scale per row (AXIS=1) or column (AXIS=0)."""
    amax = tl.max(tl.abs(x), AXIS)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    xs = x / tl.expand_dims(scale, AXIS)
    hi = xs.to(tl.float8e4nv)
    lo = ((xs - hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    return hi, lo, scale


@triton.jit
def _tile(k_ptr, v_ptr, tables_ptr, b, kvh, tile_start, offs, dims, stride_kb, stride_kt, stride_kh, stride_tb,
          PAGE: tl.constexpr):
    """One tile's K and V (plain loads: tiles lie within pages), as stored."""
    page = tl.load(tables_ptr + b * stride_tb + tile_start // PAGE).to(tl.int64)
    row = (tile_start % PAGE + offs)[:, None]
    base = page * stride_kb + row * stride_kt + kvh * stride_kh + dims[None, :]
    return tl.load(k_ptr + base), tl.load(v_ptr + base)


@triton.jit
def _var_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, seq_lens_ptr, out_ptr, qk_scale,
                stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_N: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None],
                other=0.0).to(tl.float32)
    qk_scale = qk_scale * tl.load(k_scale_ptr)
    q_hi, q_lo, s1 = _e4m3_parts(q, 1)
    q16 = q.to(tl.float16)
    row_scale = s1 * qk_scale
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for tile_start in range(0, seq_len, BLOCK_N):
        k, v = _tile(k_ptr, v_ptr, tables_ptr, b, kvh, tile_start, offs, dims, stride_kb, stride_kt, stride_kh,
                     stride_tb, PAGE)
        live = tile_start + offs < seq_len
        if QK == 0:
            s = tl.dot(q16, tl.trans(k.to(tl.float16))) * qk_scale
        elif QK == 1:
            kt = tl.trans(k)
            s = (tl.dot(q_hi, kt) + tl.dot(q_lo, kt) * 0.0625) * row_scale[:, None]
        else:
            s = tl.dot(q_hi, tl.trans(k)) * row_scale[:, None]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV == 0:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        else:
            ps = p * 256.0
            p_hi = ps.to(tl.float8e4nv)
            p_lo = ((ps - p_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
            pv = (tl.dot(p_hi, v) + tl.dot(p_lo, v) * 0.0625) * 0.00390625
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc * tl.load(v_scale_ptr) / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def var_decode(q, k, v, tables, lens, scale, ks, vs, qk, pv, block_n=128, warps=4, stages=3):
    batch, heads, dim = q.shape
    _, page, kvh, _ = k.shape
    out = torch.empty_like(q)
    _var_kernel[(batch, kvh)](q, k, v, ks, vs, tables, lens, out, scale * td.LOG2E, q.stride(0), q.stride(1),
                              k.stride(0), k.stride(1), k.stride(2), tables.stride(0), out.stride(0), out.stride(1),
                              GROUP=heads // kvh, GROUP_P=16, HEAD_DIM=dim, PAGE=page, BLOCK_N=block_n, QK=qk, PV=pv,
                              num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _swap_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, seq_lens_ptr, out_ptr, qk_scale,
                 stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                 GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, QK: tl.constexpr):
    """Transposed: scores^T = K q^T and out^T = V^T p^T, so the tile is the dots' M (wgmma-sized)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    qt = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + dims[:, None], mask=row_ok[None, :],
                 other=0.0).to(tl.float32)  # [D, G]
    qk_scale = qk_scale * tl.load(k_scale_ptr)
    q_hi, q_lo, s1 = _e4m3_parts(qt, 0)
    q16 = qt.to(tl.float16)
    col_scale = s1 * qk_scale
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([HEAD_DIM, GROUP_P], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for tile_start in range(0, seq_len, BLOCK_N):
        k, v = _tile(k_ptr, v_ptr, tables_ptr, b, kvh, tile_start, offs, dims, stride_kb, stride_kt, stride_kh,
                     stride_tb, PAGE)
        live = tile_start + offs < seq_len
        if QK == 0:
            s = tl.dot(k.to(tl.float16), q16) * qk_scale
        else:
            s = (tl.dot(k, q_hi) + tl.dot(k, q_lo) * 0.0625) * col_scale[None, :]
        s = tl.where(live[:, None], s, float("-inf"))  # [N, G]
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float16)), p.to(tl.float16))
        m_i = m_new
    out = acc * tl.load(v_scale_ptr) / l_i[None, :]
    tl.store(out_ptr + b * stride_ob + heads[None, :] * stride_oh + dims[:, None], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[None, :])


def swap_decode(q, k, v, tables, lens, scale, ks, vs, qk, block_n=128, warps=4, stages=3, gp=16):
    batch, heads, dim = q.shape
    _, page, kvh, _ = k.shape
    out = torch.empty_like(q)
    _swap_kernel[(batch, kvh)](q, k, v, ks, vs, tables, lens, out, scale * td.LOG2E, q.stride(0), q.stride(1),
                               k.stride(0), k.stride(1), k.stride(2), tables.stride(0), out.stride(0), out.stride(1),
                               GROUP=heads // kvh, GROUP_P=gp, HEAD_DIM=dim, PAGE=page, BLOCK_N=block_n, QK=qk,
                               num_warps=warps, num_stages=stages)
    return out


def main():
    dev = torch.device("cuda")
    kv_heads, dim = DECODE_SHAPE["kv_heads"], DECODE_SHAPE["dim"]
    q, k16, v16, k8, v8, tables, lens = decode_case(**DECODE_SHAPE)
    q = q * 3  # scores of a few units, as a trained model's: the softmax is not flat
    one = torch.tensor(1.0, device=dev)
    tokens = int(lens.sum())
    scale = dim ** -0.5
    # float32 reference on the fp8 values, a few sequences
    ref = td.paged_decode(q, k8, v8, tables, lens, scale, 1, one, one)
    idx = [0, 7, 100, 255]
    exact = []
    for i in idx:
        n = int(lens[i])
        pages = tables[i, : (n + 255) // 256].long()
        kk = k8[pages].float().reshape(-1, kv_heads, dim)[:n]
        vv = v8[pages].float().reshape(-1, kv_heads, dim)[:n]
        qq = q[i].float().view(kv_heads, -1, dim)
        a = torch.softmax(torch.einsum("hgd,nhd->hgn", qq, kk) * scale, -1)
        exact.append(torch.einsum("hgn,nhd->hgd", a, vv).reshape(-1, dim))
    exact = torch.stack(exact)

    def err(out):
        return (out[idx].float() - exact).abs().max().item()

    print(f"shipped kernel vs float32: {err(ref):.2e}")

    def report(label, fn, elem_bytes):
        try:
            out = fn()
            ms = cuda_ms(fn, iters=30)
            gbs = 2 * tokens * kv_heads * dim * elem_bytes / ms / 1e6
            print(f"{label:<44} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s  err vs f32 {err(out):.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001  (a variant that does not compile: the next)
            print(f"{label:<44} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    report("shipped fp8 (1 split)", lambda: td.paged_decode(q, k8, v8, tables, lens, scale, 1, one, one), 1)
    report("shipped bf16 (1 split)", lambda: td.paged_decode(q, k16, v16, tables, lens, scale, 1), 2)
    rot = torch.eye(dim, device=dev, dtype=torch.bfloat16)
    report("shipped fp8 + rotation", lambda: td.paged_decode(q, k8, v8, tables, lens, scale, 1, one, one,
                                                              rotation=rot), 1)
    for qk, pv in ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)):
        for n, w, s in ((128, 4, 3), (64, 4, 3), (128, 8, 3), (256, 8, 2)):
            report(f"var qk={qk} pv={pv} n={n} w={w} s={s}",
                   lambda: var_decode(q, k8, v8, tables, lens, scale, one, one, qk, pv, n, w, s), 1)
    for qk in (0, 1):
        for n, w, s in ((128, 4, 3), (64, 4, 3), (128, 8, 3), (256, 8, 2), (128, 4, 2)):
            report(f"swap qk={qk} n={n} w={w} s={s}",
                   lambda: swap_decode(q, k8, v8, tables, lens, scale, one, one, qk, n, w, s), 1)
        report(f"swap qk={qk} n=128 w=4 s=3 gp=8",
               lambda: swap_decode(q, k8, v8, tables, lens, scale, one, one, qk, 128, 4, 3, 8), 1)


if __name__ == "__main__":
    main()
