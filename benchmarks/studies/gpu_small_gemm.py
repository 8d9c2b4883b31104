"""Small-m GEMMs y = x @ W.T on a Qwen3-0.6B decoder layer's shapes and its LM head: cuBLAS (F.linear) against
nanoplug's one/two-row kernel (nanoplug/kernels/cuda/small_gemm.py) over a sweep of its block sizes, warps and
stages, and a tl.dot variant; each timed over 28 weight copies inside one CUDA graph (so L2 holds none).
The figures behind small_gemm.py's choices (benchmarks/RESULTS.md, session 9).

usage: python benchmarks/studies/gpu_small_gemm.py [ROWS, e.g. 1,2,4,8]
"""
import itertools, sys
import torch, triton, triton.language as tl
import torch.nn.functional as F

from nanoplug.kernels.cuda.small_gemm import _small_gemm_kernel

@triton.jit
def gemv_dot(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    nmask = rn < N
    mmask = rm < M
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=nmask[:, None], other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mmask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])

def run_reduce(x, w, y, bn, bk, warps, stages):
    M, K = x.shape; N = w.shape[0]
    _small_gemm_kernel[(triton.cdiv(N, bn),)](x, w, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                              M_PAD=max(1, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk,
                                              EVEN_K=K % bk == 0, HAS_BIAS=False, num_warps=warps, num_stages=stages)
def run_dot(x, w, y, bn, bk, warps, stages):
    M, K = x.shape; N = w.shape[0]
    gemv_dot[(triton.cdiv(N, bn),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                     BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)

def bench_graph(fn, reps=28):
    """Time fn over `reps` distinct weight copies inside a CUDA graph (L2 cannot hold them all): us per call."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(reps): fn(i)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(reps): fn(i)
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10): g.replay()
        b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / (10 * reps))
    return best

shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
ms = [int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8").split(",")]
torch.manual_seed(0)
dev = "cuda"
reduce_cfgs = list(itertools.product([4, 8, 16], [256, 512, 1024], [4, 8], [1, 2, 3]))
dot_cfgs = list(itertools.product([16, 32, 64], [128, 256], [4], [2, 3, 4]))
total_best = {}
for name, (N, K) in shapes.items():
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 32 for _ in range(28)]
    for m in ms:
        x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(m, N, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        t_cublas = bench_graph(lambda i: F.linear(x, ws[i]))
        res = []
        for kind, cfgs, fn in (("reduce", reduce_cfgs, run_reduce), ("dot", dot_cfgs, run_dot)):
            if kind == "reduce" and m > 8: continue
            if kind == "dot" and m > 16: continue
            for c in cfgs:
                if kind == "reduce" and triton.next_power_of_2(m) * c[0] * c[1] / (32 * c[2]) > 256: continue
                try:
                    fn(x, ws[0], y, *c); torch.cuda.synchronize()
                    err = (y.float() - ref).abs().max().item()
                    if err > 2e-2 * ref.abs().max().item() + 1e-2:
                        print("BAD", name, m, kind, c, err); continue
                    t = bench_graph(lambda i: fn(x, ws[i], y, *c))
                    res.append((t, kind, c))
                except Exception as e:
                    print("ERR", kind, c, type(e).__name__, str(e)[:100])
        res.sort()
        gbs = N * K * 2 / (res[0][0] * 1e-6) / 1e12
        print(f"{name:8s} m={m:2d} cublas {t_cublas:6.2f} us ({N*K*2/(t_cublas*1e-6)/1e12:.2f} TB/s) | "
              f"best {res[0][0]:6.2f} us ({gbs:.2f} TB/s) {res[0][1]} {res[0][2]} | "
              + " ".join(f"{t:.2f}:{k[0]}{c}" for t, k, c in res[1:5]), flush=True)
        total_best.setdefault(m, [0, 0]); total_best[m][0] += t_cublas; total_best[m][1] += res[0][0]
for m, (a, b) in total_best.items():
    print(f"m={m}: per layer cublas {a:.2f} us, triton best {b:.2f} us; "
          f"x28 layers: {28*a/1000:.3f} vs {28*b/1000:.3f} ms")
# lm head
N, K = 151936, 1024
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 32
for m in ms:
    x = torch.randn(m, K, device=dev, dtype=torch.bfloat16); y = torch.empty(m, N, device=dev, dtype=torch.bfloat16)
    t_c = bench_graph(lambda i: F.linear(x, w), reps=4)
    configs = [(8, 1024, 4, 2), (16, 512, 4, 2), (4, 1024, 4, 1), (8, 512, 4, 3)]
    t_r = min(bench_graph(lambda i: run_reduce(x, w, y, *c), reps=4) for c in configs)
    print(f"lm_head m={m}: cublas {t_c:.1f} us, triton {t_r:.1f} us (one weight copy: partly L2-resident)")
