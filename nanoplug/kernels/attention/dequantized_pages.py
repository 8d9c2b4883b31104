"""Prefill over cached context from a cache a kernel cannot read (float8): the pages the step refers to,
dequantized into a compact scratch cache of the model's dtype, with block tables renumbered to match.

Prefill steps with cached context (chunked prefill, prefix-cache hits) are few and compute-bound, and any
paged kernel (FlashAttention) then reads the pages as usual. On a GPU one Triton launch a layer gathers,
scales and turns back both caches' pages (`_gather_kernel`); the plain way (`gather_plain`: index_select,
then `KVLayer.dequantize`'s casts and GEMMs) takes about ten launches and a round trip through memory per
step. Never used in decode, which reads the cache as stored.
"""
from __future__ import annotations

import dataclasses

import torch

from nanoplug.api import AttentionMetadata, KVLayer, import_triton, interpreting
from nanoplug.kernels.attention.rotated_cache import rotation_of

triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _gather_pages(src_ptr, dst_ptr, index_ptr, scale_ptr, rot_ptr, src_page_stride, page, chunk,
                      ROWS: tl.constexpr, DST_PAGE: tl.constexpr, CHUNK: tl.constexpr, DIM: tl.constexpr,
                      DIM_P: tl.constexpr, SCALED: tl.constexpr, ROTATE: tl.constexpr, IEEE: tl.constexpr):
        """CHUNK head rows of gathered page `page` (a page: ROWS = tokens * heads rows of DIM), read from the
        cache's page index[page], times the scale, in the model's dtype, turned back by R^T."""
        src_page = tl.load(index_ptr + page).to(tl.int64)
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        dims = tl.arange(0, DIM_P)
        dim_ok = dims < DIM
        mask = (rows < ROWS)[:, None] & dim_ok[None, :]
        offs = rows[:, None] * DIM + dims[None, :]
        x = tl.load(src_ptr + src_page * src_page_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            x = x * tl.load(scale_ptr)
        x = x.to(dst_ptr.dtype.element_ty)  # as KVLayer.dequantize: one rounding to the model's dtype first
        if ROTATE:  # R^T[i, j] = R[j, i]; float32 accumulation, one more rounding
            r_t = tl.load(rot_ptr + dims[None, :] * DIM + dims[:, None], mask=dim_ok[:, None] & dim_ok[None, :],
                          other=0.0)
            if IEEE:
                x = tl.dot(x.to(tl.float32), r_t.to(tl.float32), input_precision="ieee")
            else:
                x = tl.dot(x, r_t.to(x.dtype))
        tl.store(dst_ptr + page.to(tl.int64) * DST_PAGE + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gather_kernel(k_ptr, v_ptr, k_out_ptr, v_out_ptr, index_ptr, k_scale_ptr, v_scale_ptr, rot_ptr,
                       k_page_stride, v_page_stride,
                       ROWS: tl.constexpr, CHUNK: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
                       SCALED: tl.constexpr, ROTATE: tl.constexpr, IEEE: tl.constexpr):
        """Program (page, chunk, cache): cache 0 is K, 1 is V."""
        page, chunk = tl.program_id(0), tl.program_id(1)
        if tl.program_id(2) == 0:
            _gather_pages(k_ptr, k_out_ptr, index_ptr, k_scale_ptr, rot_ptr, k_page_stride, page, chunk, ROWS,
                          ROWS * DIM, CHUNK, DIM, DIM_P, SCALED, ROTATE, IEEE)
        else:
            _gather_pages(v_ptr, v_out_ptr, index_ptr, v_scale_ptr, rot_ptr, v_page_stride, page, chunk, ROWS,
                          ROWS * DIM, CHUNK, DIM, DIM_P, SCALED, ROTATE, IEEE)


CHUNK = 64  # head rows a program: a [64, D] tile and one dot with R^T


def _fused(cache: torch.Tensor) -> bool:
    """The kernel reads a page as one contiguous block of [tokens, heads, dim]."""
    _, page, heads, dim = cache.shape
    return cache.stride(3) == 1 and cache.stride(2) == dim and cache.stride(1) == heads * dim


class DequantizedPages:
    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """The step's referenced pages (a row's padding names the scratch page: gathered, never read)."""
        width = -(-meta.max_seqlen_k // block_size)
        tables = meta.block_tables[:, :width]
        self.index = tables.flatten().long()
        pages = torch.arange(self.index.numel(), dtype=torch.int32, device=tables.device).view(tables.shape)
        self.meta = dataclasses.replace(meta, block_tables=pages)

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: KVLayer,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(K pages, V pages) of `dtype` and the metadata whose block tables index them."""
        if triton is None or (k_cache.device.type != "cuda" and not interpreting()) \
                or not (_fused(k_cache) and _fused(v_cache)):
            return (*self.gather_plain(k_cache, v_cache, layer, dtype), self.meta)
        n = self.index.numel()
        _, page, heads, dim = k_cache.shape
        k = torch.empty((n, page, heads, dim), dtype=dtype, device=k_cache.device)
        v = torch.empty_like(k)
        rows = page * heads
        rotation = rotation_of(layer)
        scaled, rotate = layer.k_scale is not None, rotation is not None
        dummy = self.index  # stands for an absent scale or rotation (never read)
        _gather_kernel[(n, triton.cdiv(rows, CHUNK), 2)](
            k_cache, v_cache, k, v, self.index, layer.k_scale if scaled else dummy,
            layer.v_scale if scaled else dummy, rotation.contiguous() if rotate else dummy,
            k_cache.stride(0), v_cache.stride(0), ROWS=rows, CHUNK=CHUNK, DIM=dim,
            DIM_P=max(16, triton.next_power_of_2(dim)), SCALED=scaled, ROTATE=rotate,
            IEEE=dtype == torch.float32 or interpreting())
        return k, v, self.meta

    def gather_plain(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: KVLayer,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The same pages by index_select and `layer.dequantize`: the reference the kernel must equal."""
        def pages(cache):  # through an integer view: float8 tensors have no index_select
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[cache.dtype.itemsize]
            return cache.view(bits).index_select(0, self.index).view(cache.dtype)

        return layer.dequantize(pages(k_cache), pages(v_cache), dtype)
