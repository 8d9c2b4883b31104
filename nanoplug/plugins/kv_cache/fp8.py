"""KV-cache store `fp8`: K and V kept as float8 e4m3 with a float32 scale per layer, half a 2-byte cache.

One Triton launch per layer quantizes K and V of every new token on the fly and writes them at their
slots (slot -1 skipped), as the `triton` store copies them. The value stored is `x / scale` rounded to
the nearest e4m3 number (ties to even), saturated at +-448 (e4m3fn has no infinity; an overflow must not
become NaN). The rounding is done in float32 arithmetic and only an exact e4m3 value is cast: the
hardware cast rounds the same way, but Triton's CPU interpreter rounds some values wrong, and one path
everywhere keeps the interpreter tests about the code the GPU runs.

K and V are kept in a rotated basis (a normalized Hadamard matrix per head, QuaRot's idea, handed to
every layer as a `RotatedKVLayer`), turned in the store kernel itself.
e4m3 rounds each value to 3 mantissa bits, and a q.k product carried by a few large channels inherits
their rounding almost whole; rotated, every channel carries a share and the errors average out. Attention
is unchanged by it (q is turned alike and the output back: `attend`, kernels/attention/rotated_cache.py). Scales stay 1.0
(vLLM's default): rotation spreads outliers, and per-layer scales calibrated from the first request
measured worse on SmolLM2 (benchmarks/RESULTS.md).
"""
from __future__ import annotations


import torch

from nanoplug.api import KVCacheSpec, KVCacheStore, Target, import_triton, interpreting, triton_reasons
from nanoplug.kernels.attention.rotated_cache import RotatedKVLayer, attend_rotated, is_hadamard

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# where triton is missing or broken (TRITON_ERROR says why): the reason reaches the user, never a crash
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def quantize_e4m3(x, scale):
        """float32 x / scale as the nearest e4m3 value (ties to even), saturated, cast exactly."""
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        a = tl.abs(y)
        exp = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        exp = tl.maximum(exp, -6)  # below 2^-6 e4m3 is subnormal: a fixed quantum of 2^-9
        quantum = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2^(exp-3)
        inverse = ((127 + 3 - exp) << 23).to(tl.float32, bitcast=True)  # powers of two: both products exact
        rounded = ((a * inverse + 8388608.0) - 8388608.0) * quantum  # a * inverse < 16: + 2^23 rounds to even
        sign = y.to(tl.uint32, bitcast=True) & 0x80000000  # kept on zeros too: -1e-4 is -0.0, as torch rounds it
        return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)

    @triton.jit
    def _store_fp8_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                          k_stride, v_stride, ROW: tl.constexpr, ROW_P: tl.constexpr):
        """Token i: quantize its K and V rows (ROW = heads * head_dim values) into its slot."""
        i = tl.program_id(0)
        slot = tl.load(slot_ptr + i)
        if slot == -1:
            return
        cols = tl.arange(0, ROW_P)
        mask = cols < ROW
        k = tl.load(k_ptr + i * k_stride + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + i * v_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(k_cache_ptr + slot * ROW + cols, quantize_e4m3(k, tl.load(k_scale_ptr)), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + cols, quantize_e4m3(v, tl.load(v_scale_ptr)), mask=mask)

    @triton.jit(do_not_specialize=["n"])  # a step's token count must not pick another compiled variant
    def _store_fp8_rotated_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, rot_ptr,
                                  n, k_stride, v_stride, HEADS: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
                                  ROWS: tl.constexpr, IEEE: tl.constexpr):
        """ROWS head rows (token * HEADS + head) of K and V times the rotation (one dot each, float32
        accumulation, no rounding before the quantization), quantized into their tokens' slots."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        token = rows // HEADS
        head = rows % HEADS
        slot = tl.load(slot_ptr + token, mask=token < n, other=-1)
        dims = tl.arange(0, DIM_P)
        dim_ok = dims < DIM
        mask = ((token < n) & (slot != -1))[:, None] & dim_ok[None, :]
        src = token[:, None].to(tl.int64) * k_stride + head[:, None] * DIM + dims[None, :]
        r = tl.load(rot_ptr + dims[:, None] * DIM + dims[None, :], mask=dim_ok[:, None] & dim_ok[None, :], other=0.0)
        k = tl.load(k_ptr + src, mask=mask, other=0.0)
        v = tl.load(v_ptr + token[:, None].to(tl.int64) * v_stride + head[:, None] * DIM + dims[None, :], mask=mask,
                    other=0.0)
        if IEEE:
            r = r.to(tl.float32)
            k = tl.dot(k.to(tl.float32), r, input_precision="ieee")
            v = tl.dot(v.to(tl.float32), r, input_precision="ieee")
        else:
            r = r.to(k.dtype)
            k, v = tl.dot(k, r), tl.dot(v, r)
        dst = slot[:, None] * (HEADS * DIM) + head[:, None] * DIM + dims[None, :]
        tl.store(k_cache_ptr + dst, quantize_e4m3(k, tl.load(k_scale_ptr)), mask=mask)
        tl.store(v_cache_ptr + dst, quantize_e4m3(v, tl.load(v_scale_ptr)), mask=mask)


# head rows a program: tl.dot's least M, and enough programs to fill the GPU at batch 256; 8 warps load the
# rotation faster than 4 (benchmarks/RESULTS.md, session 15)
ROTATED_ROWS = 16


def quantize_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch quantization the kernel must equal: x / scale, saturated, rounded to e4m3."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def hadamard(n: int) -> torch.Tensor:
    """The normalized Hadamard matrix of order n (Sylvester's construction; symmetric, its own inverse), or,
    for an n that is no power of two, a fixed random orthogonal matrix."""
    if n & (n - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return h / n ** 0.5
    q, r = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A cache tensor read back as `dtype` (float32 product first, so a scale costs no extra rounding)."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.float()).to(dtype)


class Fp8Store(KVCacheStore):
    description = "float8 e4m3 K/V with per-layer scales (half a 16-bit cache), fused Triton quantizing store"
    priority = 5  # opt-in: it trades a little accuracy for memory, so "auto" keeps the model's dtype

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = triton_reasons(TRITON_ERROR, target.device.type)
        if target.device.type == "cuda" and torch.cuda.is_available() \
                and torch.cuda.get_device_capability(target.device) < (8, 9):
            cap = torch.cuda.get_device_capability(target.device)
            reasons.append(f"float8 e4m3 needs compute capability 8.9 or newer (Ada, Hopper), this GPU has "
                           f"{cap[0]}.{cap[1]}")
        if target.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"stores K/V of a float16, bfloat16 or float32 model (got {target.dtype})")
        return reasons

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return FP8

    def scales(self, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(spec.num_layers), torch.ones(spec.num_layers)

    _rotation: tuple | None = None  # (device, dtype, R there, whether R is Hadamard's), made once per worker

    def layer(self, index, spec, device, dtype) -> RotatedKVLayer:
        """Every layer keeps K and V in the normalized Hadamard basis (R in the model's dtype, on the device)."""
        if self._rotation is None or self._rotation[:2] != (device, dtype):
            r = hadamard(spec.head_dim).to(device, dtype)
            self._rotation = (device, dtype, r, is_hadamard(r))  # one host read, at start-up
        _, _, r, fused = self._rotation
        plain = super().layer(index, spec, device, dtype)
        return RotatedKVLayer(plain.index, plain.k_scale, plain.v_scale, r, fused)

    def attend(self, backend, q, k, v, k_cache, v_cache, slot_mapping, layer):
        # the store kernel turns K and V into the rotated basis itself
        return attend_rotated(self, backend, q, k, v, k_cache, v_cache, slot_mapping, layer, store_turns=True)

    def store(self, k, v, k_cache, v_cache, slot_mapping, layer) -> None:
        n, heads, dim = k.shape
        row = heads * dim
        if isinstance(layer, RotatedKVLayer):
            if k.stride(-1) != 1 or k.stride(1) != dim:
                k = k.contiguous()
            if v.stride(-1) != 1 or v.stride(1) != dim:
                v = v.contiguous()
            # float32 dots for float32 models and in the CPU interpreter (its bfloat16 tl.dot is wrong)
            ieee = k.dtype == torch.float32 or interpreting()
            _store_fp8_rotated_kernel[(triton.cdiv(n * heads, ROTATED_ROWS),)](
                k, v, k_cache, v_cache, slot_mapping, layer.k_scale, layer.v_scale, layer.rotation.contiguous(), n,
                k.stride(0), v.stride(0), HEADS=heads, DIM=dim, DIM_P=max(16, triton.next_power_of_2(dim)),
                ROWS=ROTATED_ROWS, IEEE=ieee, num_warps=8)
            return
        k, v = k.reshape(n, row), v.reshape(n, row)
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        _store_fp8_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, layer.k_scale, layer.v_scale,
                                k.stride(0), v.stride(0), ROW=row, ROW_P=triton.next_power_of_2(row))
