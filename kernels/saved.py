"""Measure what a forward pass saves for backward (DESIGN: memory is measured, not asserted)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes(fn: Callable[[], torch.Tensor], exclude: list[torch.Tensor] | tuple = ()) -> int:
    """Bytes of distinct storages saved for backward while ``fn()`` runs (torch.autograd.graph hooks).
    Storages of ``exclude`` (e.g. a model's parameters, which exist anyway) are not counted."""
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in exclude}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() in skip:
            return t
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
