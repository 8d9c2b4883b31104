"""KV-cache store `torch`: an indexed copy into the flattened cache (the plain reference store)."""
from __future__ import annotations

from nanoplug.api import KVCacheStore


class TorchStore(KVCacheStore):
    description = "index_copy_ into the flattened cache (plain PyTorch)"
    priority = 10

    def store(self, k, v, k_cache, v_cache, slot_mapping, layer) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
