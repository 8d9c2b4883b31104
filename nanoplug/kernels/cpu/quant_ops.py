"""The GGUF-quantized weight kernels (quant.cpp) as torch functions: repack a weight's GGUF blocks once,
dequantize rows of it exactly, and multiply activations by it with the blocks read directly.

quant.cpp is built as its own library without `-march` flags: its AVX-512 (VNNI), AVX2 and Arm dot-product
paths are compiled for their targets inside it and chosen at run time from what this CPU reports, and the
portable C++ path serves elsewhere (and in tests). `quant_kernels()` returns the loaded kernels or raises
`KernelsUnavailable` with the reason.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
from typing import Callable

import torch

from nanoplug.kernels.cpu.build import BuiltLibrary, IsaKernels, KernelsUnavailable

ABI_VERSION = 3
SOURCE = pathlib.Path(__file__).with_name("quant.cpp")
LIBRARY_NAME = "libnanoplug_quant.so"
# no -march: the SIMD paths carry their own target attributes; -ffp-contract=off keeps the portable
# path's float math as written
VARIANTS = (["-ffp-contract=off", "-fopenmp"], ["-ffp-contract=off"])

# GGML type ids of the formats served, and (weights per block, bytes per block) in the file
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12}
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144)}
ISAS = ("portable", "avx2", "avx512", "neon_dot")  # index = the id quant.cpp takes
SIMD_Q5_0 = ("avx2", "avx512")  # the paths with Q5_0 code of their own (Arm's NEON takes the portable one)
ISA_ENV = "NANOPLUG_CPU_ISA"  # one of ISAS: the path used instead of the best this CPU runs
# how the activations meet the weights (index = quant.cpp's id): in float32; quantized to int8 blocks (as
# llama.cpp); int8 blocks of x and of its residual (float32 compute's quality at int8 dot products)
ACTS = ("float", "int8", "int8x2")

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "np_q_isa_supported": (_C, [_C]),
    "np_q_packed_size": (_I, [_C, _I, _I]),
    "np_q_pack": (_C, [_C, _P, _I, _I, _P]),
    "np_q_dequant_rows": (_C, [_C, _P, _I, _I, _P, _I, _P]),
    "np_q_quantize_act": (_C, [_C, _P, _I, _I, _I, _P, _P, _P, _P]),
    "np_q_linear": (_C, [_C, _C, _C, _P, _I, _I, _P, _I, _I, _P, _P]),
}


def format_id(fmt: int | str) -> int:
    """A format's GGML type id from its name ("Q4_1") or id; ValueError naming the ones served."""
    fid = FORMATS.get(fmt) if isinstance(fmt, str) else fmt
    if fid not in BLOCKS:
        raise ValueError(f"GGUF format {fmt!r} is not served by the CPU kernels; they serve {', '.join(FORMATS)}")
    return fid


def act_id(act: str) -> int:
    """quant.cpp's id of an activation mode; ValueError naming the modes."""
    if act not in ACTS:
        raise ValueError(f"activations {act!r}: the CPU kernels take one of {', '.join(ACTS)}")
    return ACTS.index(act)


def row_bytes(fmt: int | str, k: int) -> int:
    """Bytes of one row of k weights in the file's blocks."""
    block, size = BLOCKS[format_id(fmt)]
    return k // block * size


class QuantKernels(IsaKernels):
    """Uses torch tensors: uint8 for packed weights, float32 for activations and outputs."""

    def __init__(self, path: pathlib.Path):
        super().__init__(path, "np_q", ABI_VERSION, _SIGNATURES, ISAS)
        forced = os.environ.get(ISA_ENV, "").strip()
        if forced:  # the AVX2 or portable path on a machine that has more (tests, measurements)
            if forced not in self.isas:
                raise KernelsUnavailable(f"${ISA_ENV}={forced!r}: this CPU runs {', '.join(self.isas)}")
            self.best = forced

    def packed_size(self, fmt: int | str, n: int, k: int) -> int:
        size = self._lib.np_q_packed_size(format_id(fmt), n, k)
        if size < 0:
            block = BLOCKS[format_id(fmt)][0]
            raise ValueError(f"a [{n}, {k}] weight cannot be {fmt}: its rows must be whole blocks of {block}")
        return size

    def pack(self, fmt: int | str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The file's blocks of a [n, k] weight (uint8 [n, row_bytes], rows in order) -> the packed form."""
        fid = format_id(fmt)
        want = (n, row_bytes(fid, k))
        if raw.dtype != torch.uint8 or tuple(raw.shape) != want:
            raise ValueError(f"{fmt} blocks of a [{n}, {k}] weight are uint8 {list(want)}, not {raw.dtype} {list(raw.shape)}")
        raw = raw.contiguous()
        out = torch.empty(self.packed_size(fid, n, k), dtype=torch.uint8)
        self._lib.np_q_pack(fid, raw.data_ptr(), n, k, out.data_ptr())
        return out

    def dequantize(self, fmt: int | str, packed: torch.Tensor, n: int, k: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `rows` (int64, any shape) of the weight, or all of it, exactly as gguf-py dequantizes them:
        float32 [*rows.shape, k] or [n, k]."""
        fid = format_id(fmt)
        if rows is None:
            out = torch.empty(n, k, dtype=torch.float32)
            rc = self._lib.np_q_dequant_rows(fid, packed.data_ptr(), n, k, None, n, out.data_ptr())
        else:
            flat = rows.reshape(-1)
            if flat.dtype != torch.int64 or not flat.is_contiguous():
                flat = flat.to(torch.int64).contiguous()
            out = torch.empty(*rows.shape, k, dtype=torch.float32)
            rc = self._lib.np_q_dequant_rows(fid, packed.data_ptr(), n, k, flat.data_ptr(), flat.numel(), out.data_ptr())
        if rc != 0:
            raise IndexError(f"row ids out of range for a weight of {n} rows") if rows is not None else ValueError(
                f"not a {fmt} weight of [{n}, {k}]")
        return out

    def quantize_activations(self, x: torch.Tensor, isa: str | None = None):
        """x [M, K] -> (int8 q [M, K], scale d [M, K/32], d*sum s [M, K/32], int32 sum [M, K/32]),
        the int8 blocks the int8 path multiplies with."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        d, s = torch.empty(m, k // 32), torch.empty(m, k // 32)
        isum = torch.empty(m, k // 32, dtype=torch.int32)
        rc = self._lib.np_q_quantize_act(self._isa(isa), x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr(),
                                         s.data_ptr(), isum.data_ptr())
        if rc != 0:
            raise ValueError(f"activations of {k} features are not whole blocks of 32")
        return q, d, s, isum

    def linear(self, x: torch.Tensor, fmt: int | str, packed: torch.Tensor, n: int, k: int,
               bias: torch.Tensor | None = None, act: str = "int8x2", isa: str | None = None) -> torch.Tensor:
        """`F.linear(x, W, bias)` for float32 x [M, k] and the packed weight W [n, k], the activations
        met as `act` says (one of ACTS)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32:
            raise ValueError(f"the quantized linear takes float32 [rows, {k}], not {x.dtype} {list(x.shape)}")
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = self._lib.np_q_linear(self._isa(isa), act_id(act), format_id(fmt), x.data_ptr(), x.stride(0), x.shape[0],
                                   packed.data_ptr(), n, k, 0 if bias is None else bias.data_ptr(), y.data_ptr())
        if rc != 0:
            raise ValueError(f"not a {fmt} weight of [{n}, {k}]")
        return y


    def matmul(self, fmt: int | str, packed: torch.Tensor, n: int, k: int,
               isa: str | None = None) -> Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]:
        """`mm(x, bias, act)`: `linear` for this one packed weight, its format, shape and path checked once
        here rather than on every call (a decode step makes ~120 of them); `act` is an index of ACTS."""
        fn, isa_id, fid, ptr = self._lib.np_q_linear, self._isa(isa), format_id(fmt), packed.data_ptr()
        self.packed_size(fid, n, k)  # a shape the format cannot have raises here
        if packed.numel() < self.packed_size(fid, n, k) or packed.dtype != torch.uint8:
            raise ValueError(f"not a packed {fmt} weight of [{n}, {k}]")
        f32, empty = torch.float32, torch.empty

        def mm(x: torch.Tensor, bias: torch.Tensor | None, act: int) -> torch.Tensor:
            if x.dim() != 2 or x.stride(-1) != 1:
                x = x.reshape(-1, x.shape[-1]).contiguous()
            if x.shape[1] != k or x.dtype != f32:
                raise ValueError(f"the quantized linear takes float32 [rows, {k}], not {x.dtype} {list(x.shape)}")
            y = empty(x.shape[0], n, dtype=f32)
            fn(isa_id, act, fid, x.data_ptr(), x.stride(0), x.shape[0], ptr, n, k,
               None if bias is None else bias.data_ptr(), y.data_ptr())
            return y

        return mm


_LIBRARY = BuiltLibrary(QuantKernels, SOURCE, LIBRARY_NAME, VARIANTS)
unavailable = _LIBRARY.unavailable  # why the kernels cannot run here (building them if needed), or None
quant_kernels = _LIBRARY.get  # the loaded kernels (built on first call); raises KernelsUnavailable with the reason
