"""KV-cache store `cpu`: K and V of every new token written to their slots by one C++ call (nanoplug/kernels/cpu).

The plain store's two `index_copy_`s a layer cost a CPU decode step about 5 us each in dispatch for a few hundred
bytes of copying: 0.3 ms of a 4 ms SmolLM2-135M step at batch 1. The kernel copies both rows per token in one call,
which a recorded decode step (the cpu platform's graphs) replays like its other kernels. It copies, never converts:
it serves a cache of the model's dtype (`fp16` keeps its own store).
"""
from __future__ import annotations

from nanoplug.api import KVCacheStore, Target
from nanoplug.kernels import cpu as cpu_kernels


class CpuStore(KVCacheStore):
    description = "one C++ call copies K and V of the new tokens to their slots (CPU, built once per machine)"
    priority = 30

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if target.device.type != "cpu":
            return [f"runs on the CPU, not {target.device.type}; use triton or torch there"]
        if target.cache_dtype != target.dtype:
            return [f"copies K/V as the model computes them ({str(target.dtype).removeprefix('torch.')}), not into a "
                    f"{str(target.cache_dtype).removeprefix('torch.')} cache"]
        why = cpu_kernels.unavailable()
        return [why] if why is not None else []

    def __init__(self):
        self.kernels = cpu_kernels.kernels()

    def store(self, k, v, k_cache, v_cache, slot_mapping, layer) -> None:
        self.kernels.kv_store(k, v, k_cache, v_cache, slot_mapping)
