"""The integer weight kernels of pre-quantized checkpoints (int_weights.cpp) as torch functions: int4 W4A16 in
kernels/quant/int4.py's layout, and int8 W8A8 on activations the caller quantized.

Built as its own library without `-march` flags, as quant.cpp is (its AVX-512 and AVX2 paths carry their own
target attributes and are chosen at run time; the portable path serves elsewhere and in tests). Its calls go
through RecordingLib, so the CPU platform's recorded decode steps replay them. `kernels()` returns the loaded
kernels or raises `KernelsUnavailable` with the reason.
"""
from __future__ import annotations

import ctypes
import pathlib

import torch

from nanoplug.kernels.cpu.build import BuiltLibrary, IsaKernels

ABI_VERSION = 1
SOURCE = pathlib.Path(__file__).with_name("int_weights.cpp")
LIBRARY_NAME = "libnanoplug_int_weights.so"
VARIANTS = (["-ffp-contract=off", "-fopenmp"], ["-ffp-contract=off"])  # quant.cpp's: see quant_ops.py
ISAS = ("portable", "avx2", "avx512")  # index = the id int_weights.cpp takes

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "np_iw_int4_linear": (_C, [_C, _P, _I, _I, _P, _P, _P, _I, _I, _I, _P]),
    "np_iw_int8_linear": (_C, [_C, _P, _P, _I, _P, _P, _I, _I, _P]),
}


class IntWeightKernels(IsaKernels):
    """CPU tensors in, a new float32 tensor out."""

    def __init__(self, path: pathlib.Path):
        super().__init__(path, "np_iw", ABI_VERSION, _SIGNATURES, ISAS)

    def int4_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    isa: str | None = None) -> torch.Tensor:
        """float32 x [M, K] (rows may be strided) @ dequantize_int4(qweight, scales, zeros).T -> float32 [M, N]."""
        n, k = qweight.shape[0], qweight.shape[1] * 8
        groups = scales.shape[1]
        if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.stride(1) != 1:
            raise ValueError(f"the int4 linear takes float32 [rows, {k}] with dense rows, not {x.dtype} {list(x.shape)}")
        if scales.dtype != torch.float32 or not scales.is_contiguous() or not qweight.is_contiguous() or (
                zeros is not None and (zeros.dtype != torch.uint8 or not zeros.is_contiguous())):
            raise ValueError("the int4 linear takes contiguous int32 qweight, float32 scales and uint8 zeros")
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = self._lib.np_iw_int4_linear(self._isa(isa), x.data_ptr(), x.stride(0), x.shape[0], qweight.data_ptr(),
                                         scales.data_ptr(), None if zeros is None else zeros.data_ptr(), n, k, groups,
                                         y.data_ptr())
        if rc != 0:
            raise ValueError(f"groups of {k // groups} columns (of {k}) are not a multiple of 16")
        return y

    def int8_linear(self, xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    isa: str | None = None) -> torch.Tensor:
        """float(int8 xq [M, K] . int8 wq [N, K], summed in int32) * x_scale [M] * w_scale [N] -> float32 [M, N]."""
        m, k = xq.shape
        n = wq.shape[0]
        for t, dtype in ((xq, torch.int8), (wq, torch.int8), (x_scale, torch.float32), (w_scale, torch.float32)):
            if t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"the int8 linear takes contiguous int8 values and float32 scales, not {t.dtype}")
        if wq.shape[1] != k or x_scale.numel() != m or w_scale.numel() != n:
            raise ValueError(f"shapes do not match: x {list(xq.shape)}, w {list(wq.shape)}")
        y = torch.empty(m, n, dtype=torch.float32)
        self._lib.np_iw_int8_linear(self._isa(isa), xq.data_ptr(), x_scale.data_ptr(), m, wq.data_ptr(),
                                    w_scale.data_ptr(), n, k, y.data_ptr())
        return y


_LIBRARY = BuiltLibrary(IntWeightKernels, SOURCE, LIBRARY_NAME, VARIANTS)
unavailable = _LIBRARY.unavailable  # why the kernels cannot run here (building them if needed), or None
kernels = _LIBRARY.get  # the loaded kernels (built on first call); raises KernelsUnavailable with the reason
