"""KV-cache store `torch`: an indexed copy into the flattened cache (the plain reference store)."""
from __future__ import annotations

from nanoplug.core.hookspecs import hookimpl
from nanoplug.core.interfaces import PLUGIN_API_VERSION, KVCacheStore

NANOPLUG_API_VERSION = PLUGIN_API_VERSION


class TorchStore(KVCacheStore):
    description = "index_copy_ into the flattened cache (plain PyTorch)"
    priority = 10

    def store(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


@hookimpl
def nanoplug_register_kv_cache(register) -> None:
    register.add("torch", TorchStore)
