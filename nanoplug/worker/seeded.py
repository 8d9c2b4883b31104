"""A seeded request's noise, keyed by (seed, token position) alone: the same tokens whatever else is in the batch."""
from __future__ import annotations

import torch


def _key(seed: int, position: int, salt: int = 0) -> int:
    return ((seed * 1_000_003 + position) ^ salt) & ((1 << 63) - 1)


def seeded_noise(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Drawn by a generator on `device` itself: drawing a vocabulary's noise on the host and copying it over
    cost a GPU step about a millisecond a seeded row."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_key(seed, position))
    return torch.empty(vocab, device=device).exponential_(generator=gen)


def seeded_uniform(seed: int, position: int, salt: int = 0) -> float:
    """A seeded row's uniform number in [0, 1) at `position` (a salt keys separate draws of one position apart)."""
    return float(torch.rand(1, generator=torch.Generator().manual_seed(_key(seed, position, salt))))
