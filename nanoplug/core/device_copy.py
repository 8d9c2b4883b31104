"""Host values onto the device without making the host wait for the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host
until all queued GPU work is done, and that would undo overlapped steps. Staging the copy through
pinned memory lets it queue behind that work instead.
"""
from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, numpy array or CPU tensor) as a `dtype` tensor on `device`, copied asynchronously."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
