"""The kernels of kquants.cpp (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS, Q5_0, Q5_1, IQ4_NL) as torch functions, with
the interface of quant_ops.QuantKernels: `pack` (the file's blocks kept as they are, one contiguous copy),
`dequantize` rows exactly as gguf-py does, `linear`/`matmul` with the activations of any mode of
quant_ops.ACTS: int8 blocks of x and of its residual (int8x2, float32 compute's quality), int8 blocks as
llama.cpp's (its Q8_K blocks for the K-quants, blocks of 32 for the others), or float32 ones (the slow path:
each weight row dequantized).

kquants.cpp is built as its own library without `-march` flags, its AVX-512 VNNI and AVX2 paths chosen
at run time from what this CPU reports (the portable path serves elsewhere, and in tests).
`kquant_kernels()` returns the loaded kernels or raises `KernelsUnavailable` with the reason.
"""
from __future__ import annotations

import ctypes
import pathlib
from typing import Callable

import torch

from nanoplug.kernels.cpu.build import BuiltLibrary, IsaKernels
from nanoplug.kernels.cpu.quant_ops import act_id

ABI_VERSION = 2
SOURCE = pathlib.Path(__file__).with_name("kquants.cpp")
LIBRARY_NAME = "libnanoplug_kquants.so"
VARIANTS = (["-ffp-contract=off", "-fopenmp"], ["-ffp-contract=off"])

# GGML type ids of the formats served, and (weights per block, bytes per block) in the file
FORMATS = {"Q5_0": 6, "Q5_1": 7, "Q2_K": 10, "Q3_K": 11, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}
BLOCKS = {6: (32, 22), 7: (32, 24), 10: (256, 84), 11: (256, 110), 13: (256, 176), 14: (256, 210),
          20: (32, 18), 23: (256, 136)}
K_QUANTS = frozenset({10, 11, 13, 14, 23})  # int8 activations in Q8_K blocks of 256 (others: blocks of 32)
ISAS = ("portable", "avx2", "avx512")

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "np_kq_isa_supported": (_C, [_C]),
    "np_kq_row_bytes": (_I, [_C, _I]),
    "np_kq_dequant_rows": (_C, [_C, _P, _I, _I, _P, _I, _P]),
    "np_kq_quantize_act": (_C, [_C, _C, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P]),
    "np_kq_linear": (_C, [_C, _C, _C, _P, _I, _I, _P, _I, _I, _P, _P]),
}


def format_id(fmt: int | str) -> int:
    fid = FORMATS.get(fmt) if isinstance(fmt, str) else fmt
    if fid not in BLOCKS:
        raise ValueError(f"GGUF format {fmt!r} is not served by the K-quant kernels; they serve {', '.join(FORMATS)}")
    return fid


def row_bytes(fmt: int | str, k: int) -> int:
    block, size = BLOCKS[format_id(fmt)]
    if k % block:
        raise ValueError(f"a {fmt} weight needs rows of whole blocks of {block}; it has {k} columns")
    return k // block * size


class KQuantKernels(IsaKernels):
    """Uses torch tensors: uint8 for the weights' blocks, float32 for activations and outputs."""

    def __init__(self, path: pathlib.Path):
        super().__init__(path, "np_kq", ABI_VERSION, _SIGNATURES, ISAS)

    def packed_size(self, fmt: int | str, n: int, k: int) -> int:
        return n * row_bytes(fmt, k)

    def pack(self, fmt: int | str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The file's blocks of a [n, k] weight (uint8 [n, row bytes]), kept as they are: one contiguous copy."""
        want = (n, row_bytes(fmt, k))
        if raw.dtype != torch.uint8 or tuple(raw.shape) != want:
            raise ValueError(f"{fmt} blocks of a [{n}, {k}] weight are uint8 {list(want)}, not {raw.dtype} {list(raw.shape)}")
        return raw.contiguous().clone()

    def dequantize(self, fmt: int | str, packed: torch.Tensor, n: int, k: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `rows` (any shape) of the weight, or all of it, exactly as gguf-py dequantizes them (float32)."""
        fid = format_id(fmt)
        if packed.numel() < n * row_bytes(fid, k):
            raise ValueError(f"not a {fmt} weight of [{n}, {k}]")
        if rows is None:
            out = torch.empty(n, k, dtype=torch.float32)
            rc = self._lib.np_kq_dequant_rows(fid, packed.data_ptr(), n, k, None, n, out.data_ptr())
        else:
            flat = rows.reshape(-1).to(torch.int64).contiguous()
            out = torch.empty(*rows.shape, k, dtype=torch.float32)
            rc = self._lib.np_kq_dequant_rows(fid, packed.data_ptr(), n, k, flat.data_ptr(), flat.numel(), out.data_ptr())
        if rc != 0:
            raise IndexError(f"row ids out of range for a weight of {n} rows")
        return out

    def quantize_activations(self, fmt: int | str, x: torch.Tensor, residual: bool = False, isa: str | None = None):
        """x [M, K] -> (int8 q [M, K], float32 scales d [M, blocks], int32 sums): the activation blocks the
        int8 path multiplies `fmt` with (K-quants: llama.cpp's Q8_K, blocks of 256 and sums of 16; others:
        blocks of 32 and their sums). `residual`: the int8x2 path's second set too, the blocks of
        x - d * q, as (q, d, sums, q2, d2, sums2). Every path (`isa`) computes the same values."""
        fid = format_id(fmt)
        x = x if x.stride(-1) == 1 else x.contiguous()
        m, k = x.shape
        row_bytes(fid, k)
        block = 256 if fid in K_QUANTS else 32

        def blocks():
            return (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // block),
                    torch.empty(m, k // 16 if fid in K_QUANTS else k // 32, dtype=torch.int32))

        sets = blocks() + (blocks() if residual else (None, None, None))
        self._lib.np_kq_quantize_act(self._isa(isa), fid, x.data_ptr(), x.stride(0), m, k,
                                     *(None if t is None else t.data_ptr() for t in sets))
        return sets if residual else sets[:3]

    def linear(self, x: torch.Tensor, fmt: int | str, packed: torch.Tensor, n: int, k: int,
               bias: torch.Tensor | None = None, act: str = "int8x2", isa: str | None = None) -> torch.Tensor:
        """`F.linear(x, W, bias)` for float32 x [M, k] and W [n, k] in its blocks, the activations met as
        `act` (one of quant_ops.ACTS) says."""
        return self.matmul(fmt, packed, n, k, isa)(x, bias, act_id(act))

    def matmul(self, fmt: int | str, packed: torch.Tensor, n: int, k: int,
               isa: str | None = None) -> Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]:
        """`mm(x, bias, act)` for this one weight, its format, shape and path checked once here; `act` is an
        index of quant_ops.ACTS (quant_ops.QuantKernels.matmul's interface)."""
        fn, isa_id, fid, ptr = self._lib.np_kq_linear, self._isa(isa), format_id(fmt), packed.data_ptr()
        if packed.dtype != torch.uint8 or packed.numel() < n * row_bytes(fid, k):
            raise ValueError(f"not a {fmt} weight of [{n}, {k}] in its blocks")
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


_LIBRARY = BuiltLibrary(KQuantKernels, SOURCE, LIBRARY_NAME, VARIANTS)
unavailable = _LIBRARY.unavailable  # why the kernels cannot run here (building them if needed), or None
kquant_kernels = _LIBRARY.get  # the loaded kernels (built on first call); raises KernelsUnavailable with the reason
