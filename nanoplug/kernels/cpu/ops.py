"""The compiled kernels as torch functions: each checks the layout it needs, allocates its output and
passes raw pointers through ctypes (a call costs a few microseconds, no torch headers to compile)."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from nanoplug.kernels.cpu.record import RecordingLib
from nanoplug.kernels.cpu.build import KernelsUnavailable

ABI_VERSION = 4
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "np_rms_norm": (None, [_P, _I, _I, _P, _P, _I, _I, _F]),
    "np_add_rms_norm": (None, [_P, _P, _P, _P, _P, _I, _I, _F]),
    "np_silu_and_mul": (None, [_P, _P, _I, _I]),
    "np_rope": (None, [_P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I]),
    "np_argmax_rows": (None, [_P, _I, _I, _I, _P]),
    "np_packed_size": (ctypes.c_int64, [_I, _I]),
    "np_pack_weight": (None, [_P, _I, _I, _P]),
    "np_linear": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _I, _I]),
    "np_paged_decode": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F]),
    "np_paged_decode_f16": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F]),
    "np_kv_store": (None, [_P, _I, _P, _I, _P, _P, _P, _I, _I]),
}
DECODE_HEAD_DIMS = (64, 128, 256)
MAX_DECODE_GROUP = 16  # query heads per KV head
GEMM_MAX_ROWS = 64


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _heads_dense(x: torch.Tensor) -> bool:
    """x [N, H, D] has each row's heads back to back (its rows may be strided, as qkv views are)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _with_dense_heads(x: torch.Tensor) -> torch.Tensor:
    return x if _heads_dense(x) else x.contiguous()


class CpuKernels:
    """float32 CPU tensors in, new tensors out (RoPE works in place, as the model's own does not need
    the unrotated q and k)."""

    def __init__(self, path: pathlib.Path):
        lib = ctypes.CDLL(str(path))
        lib.np_abi_version.restype = ctypes.c_int
        if lib.np_abi_version() != ABI_VERSION:
            raise KernelsUnavailable(f"{path} is a build of another version of the kernels; delete it to rebuild")
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._lib, self.path = RecordingLib(lib, list(_SIGNATURES)), path  # calls a graph capture records

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`F.rms_norm` over the last dim; x may be a [N, H, D] view whose heads are dense (q/k norms)."""
        dim = x.shape[-1]
        if x.dim() == 3 and _heads_dense(x):
            heads, outer = x.shape[1], x.stride(0)
        else:
            x = _dense(x)
            heads, outer = 1, dim
        out = torch.empty(x.shape, dtype=x.dtype)
        self._lib.np_rms_norm(x.data_ptr(), heads, outer, weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(rms_norm(x + residual), x + residual) in one pass."""
        x, residual = _dense(x), _dense(residual)
        out, summed = torch.empty_like(x), torch.empty_like(x)
        dim = x.shape[-1]
        self._lib.np_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                  summed.data_ptr(), x.numel() // dim, dim, eps)
        return out, summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[..., :d]) * x[..., d:]"""
        x = _dense(x)
        d = x.shape[-1] // 2
        out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)
        self._lib.np_silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
        return out

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate-half RoPE of q [N, H, D] and k [N, Hkv, D] in place; cos/sin tables are [positions, D]
        and cover every position given (the engine's tables cover max_model_len)."""
        dim = q.shape[2]
        if cos.shape[-1] != dim or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"the RoPE kernel needs dense cos/sin tables of the head size {dim}, not {tuple(cos.shape)}")
        if positions.dtype != torch.int64:
            positions = positions.long()
        q, k = _with_dense_heads(q), _with_dense_heads(k)
        positions = _dense(positions)
        self._lib.np_rope(positions.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                          cos.data_ptr(), sin.data_ptr(), q.shape[0], q.shape[1], k.shape[1], dim)
        return q, k

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight [N, K] in the layout `linear` reads (a copy: column panels, k-major)."""
        weight = _dense(weight.detach())
        out = torch.empty(self._lib.np_packed_size(*weight.shape), dtype=weight.dtype)
        self._lib.np_pack_weight(weight.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for 2-D x of at most GEMM_MAX_ROWS rows, through the packed weight."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, (n, k) = x.shape[0], weight.shape
        y = torch.empty(rows, n, dtype=x.dtype)
        rc = self._lib.np_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                 y.data_ptr(), rows, n, k)
        if rc != 0:
            raise ValueError(f"the CPU GEMM serves at most {GEMM_MAX_ROWS} rows, not {rows}")
        return y

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """`x.argmax(dim=-1)` of a 2-D tensor: the first largest value of each row (NaNs are not picked)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._lib.np_argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def kv_store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """K and V [N, Hkv, D] of N new tokens into dense caches [blocks, block_size, Hkv, D] of their dtype, row i
        at flat slot slots[i] (int64): the two `index_copy_`s of the plain store in one call."""
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.dtype != v.dtype:
            raise ValueError(f"the CPU KV store copies, it does not convert: {k.dtype} into a {k_cache.dtype} cache")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the CPU KV store writes dense caches [blocks, block_size, kv_heads, head_dim]")
        if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
            raise ValueError(f"K and V {tuple(k.shape)} / {tuple(v.shape)} do not fit cache rows "
                             f"{tuple(k_cache.shape[2:])}")
        k, v = _with_dense_heads(k), _with_dense_heads(v)
        if slots.dtype != torch.int64:
            slots = slots.long()
        slots, size = _dense(slots), k.element_size()
        self._lib.np_kv_store(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k_cache.data_ptr(),
                              v_cache.data_ptr(), slots.data_ptr(), k.shape[0], k.shape[1] * k.shape[2] * size)

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """One query token per sequence: q [B, H, D] against caches [blocks, block_size, Hkv, D] (float32, or
        float16 widened as read) through int32 block tables [B, max_blocks] and int32 context lengths [B]
        -> [B, H, D]."""
        num_seqs, heads, dim = q.shape
        q = _with_dense_heads(q)
        if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError("the CPU decode kernel takes int32 block tables and context lengths")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the CPU decode kernel reads dense caches [blocks, block_size, kv_heads, head_dim]")
        if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"the CPU decode kernel reads float32 or float16 caches, not {k_cache.dtype}")
        block_tables, seq_lens = _dense(block_tables), _dense(seq_lens)
        out = torch.empty(num_seqs, heads, dim, dtype=q.dtype)
        fn = self._lib.np_paged_decode if k_cache.dtype == torch.float32 else self._lib.np_paged_decode_f16
        rc = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                out.data_ptr(), num_seqs, heads, k_cache.shape[2], dim, k_cache.shape[1], scale)
        if rc != 0:
            raise ValueError(f"the CPU decode kernel serves head sizes {DECODE_HEAD_DIMS} with at most "
                             f"{MAX_DECODE_GROUP} query heads per KV head, not {heads}/{k_cache.shape[2]} heads of {dim}")
        return out
