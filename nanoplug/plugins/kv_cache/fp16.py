"""KV-cache store `fp16`: K and V kept in float16 whatever the model computes in (llama.cpp's default
cache type). A float32 model's cache then takes half the memory, and decode attention, which on a CPU
reads the whole cache every step, half the bytes; float16 keeps 11 significant bits, ample for K and V.
Chosen by name (`kv_cache="fp16"`), never by "auto": it changes the float32 engine's numbers."""
from __future__ import annotations

import torch

from nanoplug.api import KVCacheStore, Target


class Fp16Store(KVCacheStore):
    description = "K and V stored in float16 (half a float32 cache; the cpu decode kernel reads it directly)"
    priority = 0

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if target.dtype not in (torch.float32, torch.float16):
            return [f"the model computes in {str(target.dtype).removeprefix('torch.')}, already 2 bytes a value; "
                    "use kv_cache='torch'"]
        return []

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float16

    def store(self, k, v, k_cache, v_cache, slot_mapping, layer) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(torch.float16))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(torch.float16))
