"""A cache that keeps K and V in a rotated basis (k R, v R, R orthogonal): the fp8 store's trick, out of the SDK.

Dot products are unchanged when q is turned alike (q R) and the output turned back (o R^T), so the store
spreads outliers before quantizing and attention is untouched. The store hands each layer a
`RotatedKVLayer` (its `KVCacheStore.layer`) and wraps attention (`KVCacheStore.attend` -> `attend_rotated`):
a backend that reads the rotated cache itself (`RotatedCacheReader`, e.g. the Triton decode kernel turning q
and the output in registers) gets q, k, v in the model's basis; any other backend gets them turned, a layer
without rotation, and its output turned back (a GEMM each, every layer).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanoplug.api import AttentionBackend, KVLayer


@dataclass(frozen=True, eq=False)
class RotatedKVLayer(KVLayer):
    """A layer of a cache kept rotated: R [head_dim, head_dim] in the model's dtype, on the device."""

    rotation: torch.Tensor | None = None
    hadamard: bool = False  # R is a multiple of Sylvester's Hadamard matrix (`is_hadamard`, read once)

    def dequantize(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V scaled, then turned back into the model's basis (one GEMM in `dtype` each, float32 accumulation)."""
        k, v = super().dequantize(k, v, dtype)
        back = self.rotation.T.to(dtype)
        return torch.matmul(k, back), torch.matmul(v, back)

    @functools.cached_property
    def unrotated(self) -> KVLayer:
        """This layer as a backend sees it when `attend_rotated` does the turning: no rotation to undo."""
        return KVLayer(self.index, self.k_scale, self.v_scale)


def rotation_of(layer: KVLayer) -> torch.Tensor | None:
    """The layer's rotation, or None for a cache kept in the model's basis."""
    return layer.rotation if isinstance(layer, RotatedKVLayer) else None


class RotatedCacheReader:
    """A backend that may read a rotated cache itself (through `layer.dequantize`, or by turning q and its
    output on its own): where `reads_rotated_cache` is True it gets q, k, v in the model's basis."""

    reads_rotated_cache: bool = False


def attend_rotated(store, backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, layer: KVLayer,
                   store_turns: bool) -> torch.Tensor:
    """`KVCacheStore.attend` for a store keeping `layer` rotated. store_turns: `store.store` turns K and V
    itself (in its kernel), so it is given them in the model's basis."""
    if not isinstance(layer, RotatedKVLayer):
        store.store(k, v, k_cache, v_cache, slot_mapping, layer)
        return backend.forward(q, k, v, k_cache, v_cache, layer)
    rotation = layer.rotation
    reads = isinstance(backend, RotatedCacheReader) and backend.reads_rotated_cache
    if store_turns and reads:
        store.store(k, v, k_cache, v_cache, slot_mapping, layer)
        return backend.forward(q, k, v, k_cache, v_cache, layer)
    turned_k, turned_v = _rotate(k, rotation), _rotate(v, rotation)
    store.store(*((k, v) if store_turns else (turned_k, turned_v)), k_cache, v_cache, slot_mapping, layer)
    if reads:
        return backend.forward(q, k, v, k_cache, v_cache, layer)
    out = backend.forward(_rotate(q, rotation), turned_k, turned_v, k_cache, v_cache, layer.unrotated)
    return _rotate(out, rotation.T)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] @ rotation [D, D]: one GEMM in the model's dtype (float32 accumulation, one rounding)."""
    return torch.matmul(x, rotation)


def is_hadamard(rotation: torch.Tensor | None) -> bool:
    """True when `rotation` is a multiple of Sylvester's Hadamard matrix (the fp8 store's, in the model's dtype):
    the float8 kernel then turns q and the output itself. Reads the tensor on the host: call it once."""
    if rotation is None or rotation.shape[0] & (rotation.shape[0] - 1):
        return False
    h = torch.ones(1, 1)
    while h.shape[0] < rotation.shape[0]:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    r = rotation.detach().float().cpu()
    return torch.equal(r, h * r[0, 0])


def hadamard_of(layer: KVLayer) -> bool:
    """Whether the layer's rotation is Hadamard's (a kernel may turn q and the output in registers)."""
    return isinstance(layer, RotatedKVLayer) and layer.hadamard
