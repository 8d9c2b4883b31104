"""The pre-quantized checkpoints' GPU kernels (plugins/weight_formats/quant_kernels.py) against dequantize-then-
matmul, in bfloat16 on the 8B shape's layer sizes, where the CPU interpreter cannot check them (its float -> e4m3
cast is wrong near powers of two, its bfloat16 tl.dot too):

- the Triton block-scaled fp8 kernels: the per-token-group activation quantization equals vLLM's formula bit
  for bit; GEMV and GEMM equal the float64 product of the e4m3-rounded activations and the dequantized weights
  within float32 rounding plus the bfloat16 output's rounding, and the exact product within the fp8 rounding of
  the activations: |error| <= sum_k |w_k| (2^-4 |x_k| + s_g(k) 2^-10) (e4m3's 3 mantissa bits, round to
  nearest; half its smallest subnormal step) plus those terms; under a CUDA graph as eagerly;
- int8 W8A8 through torch._int_mm: its int32 sums exact, the result float(acc) * x_scale * w_scale;
- cuBLAS's block-scaled fp8 GEMM (SM90) within the same bounds as the Triton GEMM, under a CUDA graph as eagerly;
- fp8 per channel through torch._scaled_mm: within bfloat16 rounding of the same quantized operands;
- engines on compressed-tensors W4A16, fp8-block and W8A8 checkpoints take the kernels under CUDA graphs and give
  the CPU engine's greedy tokens (float32; the CPU's own kernels for int4 and int8); on a fine-grained FP8
  checkpoint, whose CPU path multiplies unquantized activations as transformers' does, the first token.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_quant_kernels.py`."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nanoplug.kernels.quant import fp8, triton_fp8
from nanoplug.plugins.weight_formats import quant_kernels

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)


def group_quant_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = x.float().unflatten(-1, (-1, group))
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return (g / scale).clamp(-448.0, 448.0).to(FP8).flatten(-2), scale.squeeze(-1)


def test_group_quant_equals_vllms_formula():
    x = (torch.randn(7, 4096, device="cuda") * 3).to(torch.bfloat16)
    x[2, :128] = 0
    q, s = triton_fp8.group_quant(x, 128)
    q_ref, s_ref = group_quant_reference(x, 128)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def assert_within_fp8_bounds(out, x, w_deq, tensor_cores: bool) -> None:
    """`out` (bfloat16) against the float64 product of the e4m3-rounded activations and the dequantized weights, and
    against the exact product within the fp8 rounding of the activations."""
    k = x.shape[-1]
    eps32 = torch.finfo(torch.float32).eps
    out = out.double()
    xq, xs = group_quant_reference(x, 128)
    x_rounded = (xq.double().unflatten(-1, (-1, 128)) * xs.double()[..., None]).flatten(-2)
    rounded = x_rounded @ w_deq.t()
    out_rounding = rounded.abs() * 2 ** -8  # bfloat16 output
    # fp8 tensor cores keep about 14 bits while they sum a block's 128 products (DeepSeek-V3, 3.3.2; each block's
    # sum is then added in float32): 2^-12 of sum |x w| on top of float32's rounding
    mma = 2 ** -12 if tensor_cores else 0.0
    f32 = (k * eps32 + mma) * (x_rounded.abs() @ w_deq.abs().t()) + out_rounding + 1e-9
    assert ((out - rounded).abs() <= f32).all(), (x.shape[0], ((out - rounded).abs() / f32).max())
    exact = x.double() @ w_deq.t()
    per_x = x.double().abs() * 2 ** -4 + xs.double().repeat_interleave(128, -1) * 2 ** -10
    bound = per_x @ w_deq.abs().t() + k * eps32 * (x.double().abs() @ w_deq.abs().t()) + exact.abs() * 2 ** -8
    assert ((out - exact).abs() <= bound).all(), (x.shape[0], ((out - exact).abs() / bound).max())


def assert_same_sums(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for the order of a split GEMV's float32 additions (its programs add their parts atomically, in
    whichever order they finish): one bfloat16 step of the larger value at most, where a product computed twice
    over stale or doubled partial sums would be off by whole parts."""
    assert ((got.float() - want.float()).abs() <= torch.maximum(got.float().abs(), want.float().abs()) * 2 ** -7
            + 2 ** -7 * want.float().abs().max() * 1e-2).all()


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, generator=g, device="cuda") * 64).clamp(-448, 448).to(FP8)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=g, device="cuda") * 3e-4 + 1e-4
    return w, scale, fp8.dequantize_blocks(w, scale, BLOCK, torch.float64), g


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (160, 384)])
def test_fp8_block_kernels_equal_dequantize_then_matmul(n, k):
    w, scale, w_deq, g = _weights(n, k)
    for m in (1, 4, 16, 300, 1100):  # GEMV, the GEMM in each of its configs
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        out = triton_fp8.fp8_block_matmul(x, w, scale, BLOCK)
        assert_within_fp8_bounds(out, x, w_deq, tensor_cores=m > triton_fp8.GEMV_ROWS)


def _cublas_or_skip(n: int, k: int):
    from nanoplug.kernels.quant import cublas_fp8

    why = cublas_fp8.unavailable(torch.device("cuda"), n, k, BLOCK)
    if why:  # (an H100 or H200 has it: the benchmarks' GPUs)
        pytest.skip(why)
    return cublas_fp8


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_cublas_block_gemm_equals_dequantize_then_matmul(n, k):
    cublas_fp8 = _cublas_or_skip(n, k)
    w, scale, w_deq, g = _weights(n, k)
    layer = _layer("fp8_block", w, scale, None)
    layer.block = BLOCK
    assert quant_kernels.choose(layer) is quant_kernels.fp8_block_cublas
    for m in (5, 300, 1100):  # rows padded to a multiple of 4, and not
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        assert_within_fp8_bounds(cublas_fp8.matmul(x, w, layer.cublas_scales), x, w_deq, tensor_cores=True)
        want = cublas_fp8.matmul(x, w, layer.cublas_scales)
        assert torch.equal(quant_kernels.fp8_block_cublas(layer, x[None]), want[None])
    x = torch.randn(2, k, generator=g, device="cuda").to(torch.bfloat16)  # decode rows: the Triton GEMV
    assert_same_sums(quant_kernels.fp8_block_cublas(layer, x), triton_fp8.fp8_block_matmul(x, w, scale, BLOCK))


@pytest.mark.parametrize("m", [1, 3, 40])
def test_fp8_block_kernels_replay_in_a_cuda_graph(m):
    w = (torch.randn(1024, 4096, device="cuda") * 64).to(FP8)
    scale = torch.rand(8, 32, device="cuda") * 1e-3
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    eager = triton_fp8.fp8_block_matmul(x, w, scale, BLOCK)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8.fp8_block_matmul(x, w, scale, BLOCK)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_sums(out, eager)


def test_cublas_block_gemm_replays_in_a_cuda_graph():
    cublas_fp8 = _cublas_or_skip(1024, 4096)
    w = (torch.randn(1024, 4096, device="cuda") * 64).to(FP8)
    scales = cublas_fp8.weight_scales(torch.rand(8, 32, device="cuda") * 1e-3)
    x = torch.randn(37, 4096, device="cuda").to(torch.bfloat16)
    eager = cublas_fp8.matmul(x, w, scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cublas_fp8.matmul(x, w, scales)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _layer(kind: str, qweight: torch.Tensor, scales: torch.Tensor, act) -> nn.Module:
    layer = nn.Module()
    layer.kind, layer.act, layer.qweight, layer.scales = kind, act, qweight, scales
    layer.output_size, layer.input_size = qweight.shape
    return layer


def test_int8_int_mm_is_exact_in_its_sums():
    from nanoplug.kernels.quant.activations import quantize

    wq = torch.randint(-128, 128, (4096, 12288), device="cuda", dtype=torch.int8)
    ws = torch.rand(4096, device="cuda") * 1e-3
    layer = _layer("int8", wq, ws, ("int", None))
    assert quant_kernels.choose(layer) is quant_kernels.int8_int_mm
    for m in (1, 16, 17, 300):
        x = torch.randn(m, 12288, device="cuda").to(torch.bfloat16)
        q, s = quantize(x, "int")
        acc = (q.double() @ wq.double().t())  # exact: every partial sum below 2^53
        want = (acc.float() * s.float().view(-1, 1) * ws[None, :]).to(torch.bfloat16)
        assert torch.equal(quant_kernels.int8_int_mm(layer, x), want), m


def test_fp8_channel_scaled_mm_equals_its_emulation():
    from nanoplug.kernels.quant.activations import fake_quantize

    w = (torch.randn(1024, 4096, device="cuda") * 64).to(FP8)
    ws = torch.rand(1024, device="cuda") * 1e-3
    layer = _layer("fp8", w, ws, ("float", None))
    assert quant_kernels.choose(layer) is quant_kernels.fp8_scaled_mm
    wd = fp8.dequantize_rows(w, ws, torch.float32)
    for m in (1, 300):
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        got = quant_kernels.fp8_scaled_mm(layer, x).float()
        emulated = fake_quantize(x.float(), "float") @ wd.t()
        assert ((got - emulated).norm() / emulated.norm()).item() < 1e-2


@pytest.mark.parametrize("scheme,kernel", [("w4a16", "int4_triton"), ("fp8_block_ct", "fp8_block_triton"),
                                           ("w8a8", "int8_int_mm"), ("fp8_block", "fp8_block_triton")])
def test_engines_take_the_kernels_and_give_the_cpu_tokens(tmp_path, scheme, kernel):
    from nanoplug import LLM, SamplingParams
    from nanoplug.bench.random_quantized import write_random_quantized

    # drawn in the format (compressed-tensors is not on the GPU machine; test_random_quantized.py proves the files)
    folder = write_random_quantized(tmp_path / scheme, scheme, dtype=torch.float32, hidden_size=256,
                                    intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    if kernel == "fp8_block_triton":
        from nanoplug.kernels.quant import cublas_fp8

        if cublas_fp8.unavailable(torch.device("cuda"), 256, 512, BLOCK) is None:  # SM90: batches on cuBLAS
            kernel = "fp8_block_cublas"
    tokens = {}
    for device in ("cuda", "cpu"):
        llm = LLM(str(folder), device=device, dtype="float32", max_model_len=256)
        try:
            if device == "cuda":
                assert llm.engine.worker.model.model.layers[0].mlp.down_proj.kernel is getattr(quant_kernels, kernel)
            tokens[device] = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].token_ids
        finally:
            llm.close()
    if scheme == "fp8_block":  # the CPU multiplies unquantized activations (transformers' CPU path): a random
        assert tokens["cuda"][0] == tokens["cpu"][0], tokens  # model's near ties then part; the kernel is tested above
    else:
        assert tokens["cuda"] == tokens["cpu"]
