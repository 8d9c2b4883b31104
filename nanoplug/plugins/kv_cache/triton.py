"""KV-cache store `triton`: one fused kernel writes K and V of every new token at its slot.

The plain store issues two `index_copy_` launches per layer; this kernel (nano-vllm's
`store_kvcache`) does both copies in one launch, one program per token, and skips slot -1 in the
kernel instead of on the host. On CPU it runs only under `TRITON_INTERPRET=1` (for tests).
"""
from __future__ import annotations


from nanoplug.api import KVCacheStore, Target, import_triton, triton_reasons

# where triton is missing or broken (TRITON_ERROR says why): the reason reaches the user, never a crash
triton, tl, TRITON_ERROR = import_triton()
if triton is not None:

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                         k_stride, v_stride, ROW: tl.constexpr):
        """Token i: copy its K and V rows (all KV heads, ROW = heads * head_dim values) to its slot."""
        i = tl.program_id(0)
        slot = tl.load(slot_ptr + i)
        if slot == -1:
            return
        cols = tl.arange(0, ROW)
        k = tl.load(k_ptr + i * k_stride + cols)
        v = tl.load(v_ptr + i * v_stride + cols)
        tl.store(k_cache_ptr + slot * ROW + cols, k)
        tl.store(v_cache_ptr + slot * ROW + cols, v)


class TritonStore(KVCacheStore):
    description = "fused Triton slot-mapping store (K and V in one launch, slot -1 skipped)"
    priority = 20

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        reasons = triton_reasons(TRITON_ERROR, target.device.type)
        model = target.model
        if model is not None:
            row = model.num_kv_heads * model.head_dim // max(target.tensor_parallel_size, 1)
            if row & (row - 1):
                reasons.append(f"needs num_kv_heads * head_dim per rank to be a power of two (it is {row}); "
                               "use kv_cache='torch'")
        return reasons

    def store(self, k, v, k_cache, v_cache, slot_mapping, layer) -> None:
        n, heads, dim = k.shape
        row = heads * dim
        k, v = k.reshape(n, row), v.reshape(n, row)
        if k.stride(-1) != 1:
            k = k.contiguous()
        if v.stride(-1) != 1:
            v = v.contiguous()
        _store_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row)
