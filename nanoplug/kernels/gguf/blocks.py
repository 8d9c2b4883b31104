"""GGUF blocks split, once at load, into the arrays the Triton kernels read: quants, scales and minimums
each in an array of its own, so that a row's quants are one contiguous run the GPU reads coalesced.

Every format becomes groups of 32 weights, each group one scale (and a minimum, added):
- Q8_0: int8 quants [rows, cols]; float16 scales d; value d * q.
- Q4_0, Q4_1: uint8 [rows, cols / 2] as in the file (byte j of a group: weight j low, weight j + 16
  high); float16 d (and m); values d * (q - 8), d * q + m.
- Q4_K: the same nibble order (each 64-weight chunk's bytes rewritten so); per group the float32
  product d * scale and the negated float32 product dmin * min, so d * sc * q - dmin * m is one
  multiply and one add, rounded as gguf-py rounds it.
It stays quantized: Q4_1 keeps 5 bits a weight, Q8_0 8.5, Q4_K 6.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
BLOCK_BYTES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


class Packed(NamedTuple):
    """One quantized weight [rows, cols] in the kernels' layout."""

    fmt: str
    rows: int
    cols: int
    quants: torch.Tensor          # int8 [rows, cols] (Q8_0) or uint8 [rows, cols // 2]
    scales: torch.Tensor          # [rows, cols // 32], float16 or float32
    mins: torch.Tensor | None     # [rows, cols // 32] added after the scale; None: Q8_0, Q4_0

    def to(self, device: torch.device) -> "Packed":
        move = (lambda t: None if t is None else t.to(device).contiguous())
        return self._replace(quants=move(self.quants), scales=move(self.scales), mins=move(self.mins))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins) if t is not None)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per entry (last dim 2) read as float16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _q4k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of each Q4_K super-block from its 12 packed bytes (gguf-py's order)."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def repack(fmt: str, blocks: torch.Tensor, rows: int, cols: int) -> Packed:
    """uint8 blocks [rows, bytes per row] as in the file -> the kernels' arrays (on the blocks' device)."""
    per, size = BLOCK_BYTES[fmt]
    if cols % per:
        raise ValueError(f"a {fmt} weight needs rows of whole blocks of {per}; it has {cols} columns")
    blk = blocks.reshape(rows, cols // per, size)
    if fmt == "Q8_0":
        return Packed(fmt, rows, cols, blk[..., 2:].contiguous().view(torch.int8).reshape(rows, cols),
                      _f16(blk[..., :2]), None)
    if fmt == "Q4_0":
        return Packed(fmt, rows, cols, blk[..., 2:].reshape(rows, cols // 2).contiguous(), _f16(blk[..., :2]), None)
    if fmt == "Q4_1":
        return Packed(fmt, rows, cols, blk[..., 4:].reshape(rows, cols // 2).contiguous(), _f16(blk[..., :2]),
                      _f16(blk[..., 2:4]))
    d, dmin = _f16(blk[..., 0:2]).float(), _f16(blk[..., 2:4]).float()
    sc, mn = _q4k_scales_mins(blk[..., 4:16])
    scales = (d[..., None] * sc.float()).reshape(rows, cols // 32)
    mins = (-(dmin[..., None] * mn.float())).reshape(rows, cols // 32)
    qs = blk[..., 16:].reshape(rows, cols // 256, 4, 32)  # chunk c: low nibbles sub-block 2c, high 2c + 1
    sub = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [rows, supers, 4, 2, 32]: 32 values of one sub-block
    quants = sub[..., :16] | (sub[..., 16:] << 4)  # weight j low, j + 16 high, as Q4_0/Q4_1
    return Packed(fmt, rows, cols, quants.reshape(rows, cols // 2).contiguous(), scales.contiguous(), mins.contiguous())
