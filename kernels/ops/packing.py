"""Packing of small integer codes into bytes, the one home of the saved-code layout (twins and tests).

Codes of ``bits`` ∈ {1, 2, 4, 8} bits sit little-end-first in bytes: code i is bits [bits·(i mod per), …) of
byte ⌊i/per⌋, per = 8/bits. A row of 8 codes read as one little-endian 8·bits-bit integer is the Triton kernels' layout.
Unpacking indexes a 256-row table (byte value → its ``per`` codes), one gather instead of shifts and masks.
"""

from __future__ import annotations

from functools import cache

import torch
from approxbp.kernels.ops.torch_private import unset_fake_temporarily

__all__ = ["byte_codes", "pack", "storage_bits", "unpack", "unpack_into"]


def storage_bits(bits: int) -> int:
    """Codes are stored at the next of 1, 2, 4, 8 bits so that they pack evenly into bytes."""
    return next(w for w in (1, 2, 4, 8) if w >= bits)


@cache
def _place_values(bits: int, device: torch.device) -> torch.Tensor:
    """[1, 2^bits, 2^(2·bits), …] (per entries, int32): a byte is Σ code_j · 2^(bits·j). Cached, so always real
    (never a fake tensor of a planning run, which a later real run would read)."""
    with unset_fake_temporarily():
        return 2 ** (torch.arange(8 // bits, dtype=torch.int32, device=device) * bits)


@cache
def byte_codes(bits: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[256, per]: row b holds the codes packed in byte value b (as ``dtype``, e.g. bool for branch bits). Cached,
    so always real."""
    with unset_fake_temporarily():
        shifts = torch.arange(8 // bits, device=device) * bits
        return ((torch.arange(256, device=device)[:, None] >> shifts) & ((1 << bits) - 1)).to(dtype)


def pack(codes: torch.Tensor, bits: int, nbytes: int | None = None) -> torch.Tensor:
    """Pack integer codes (< 2^bits) into ``nbytes`` bytes (default ceil(numel·bits/8); the rest is zero)."""
    per = 8 // bits
    nbytes = -(-codes.numel() // per) if nbytes is None else nbytes
    flat = torch.nn.functional.pad(codes.reshape(-1).to(torch.int32), (0, nbytes * per - codes.numel()))
    return (flat.view(nbytes, per) * _place_values(bits, codes.device)).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``numel`` codes as int64."""
    return byte_codes(bits, packed.device)[packed.long()].view(-1)[:numel]


def unpack_into(packed: torch.Tensor, by_byte: torch.Tensor, numel: int) -> torch.Tensor:
    """``by_byte[code]`` for the first ``numel`` codes, given ``by_byte`` = a per-code table already expanded to
    [256, per] (e.g. ReLU-sum levels, :func:`byte_codes` mapped through them): one gather."""
    return by_byte[packed.long()].view(-1)[:numel]
