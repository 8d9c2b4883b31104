"""The GPU tests run in two processes: one with flash_attn.cute (FlashAttention-4) importable and one
without, because xformers 0.0.35 does not import beside it (it takes flash_attn for FlashAttention-2).
In each, a backend that cannot load must say why, naming the fix, rather than pass unseen."""
from __future__ import annotations

import importlib.util


def fa4_importable() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


def reason_here(attention: str) -> str | None:
    """What the error of `attention` says where this process may lack it (None: it must load here)."""
    if attention == "flash" and not fa4_importable():
        return "pip install flash-attn"  # FlashAttention-2 may still serve
    if attention == "xformers" and fa4_importable():
        return "xformers does not import"
    return None
