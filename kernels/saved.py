"""Measure what a forward pass saves for backward (DESIGN: memory is measured, not asserted)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of distinct storages saved for backward while ``fn()`` runs (torch.autograd.graph hooks)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
