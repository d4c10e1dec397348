"""Measure what a forward pass saves for backward (DESIGN: memory is measured, not asserted)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .torch_private import storage_key

__all__ = ["charged", "saved_bytes"]


@contextlib.contextmanager
def charged(into: dict[str, int], exclude=(), model: nn.Module | None = None):
    """Within: every tensor saved for backward adds its storage's bytes, once per storage, to ``into[where]``:
    ``where`` is the innermost module of ``model`` running when it was saved (module forward hooks keep the stack;
    "(outside modules)" otherwise, or "" without a model). Storages of ``exclude`` (e.g. parameters, which exist
    anyway) are skipped. Storages are told apart by their StorageImpl (so fake tensors, with no data pointer, work),
    and every storage seen is held until the count ends: a saved tensor freed during the forward cannot hand its
    StorageImpl's address to a new storage, which would then go uncounted."""
    names = {m: n for n, m in model.named_modules()} if model is not None else {}
    stack: list[str] = []
    held = {storage_key(p): p.untyped_storage() for p in exclude}  # identity → storage, alive for the count

    def pre(module, args):
        if module in names:
            stack.append(names[module])

    def post(module, args, out):
        if module in names and stack and stack[-1] == names[module]:
            stack.pop()

    def pack(t: torch.Tensor):
        s, key = t.untyped_storage(), storage_key(t)
        if key not in held:
            held[key] = s
            key = stack[-1] if stack else ("(outside modules)" if names else "")
            into[key] = into.get(key, 0) + s.nbytes()
        return t

    handles = ([nn.modules.module.register_module_forward_pre_hook(pre),
                nn.modules.module.register_module_forward_hook(post)] if names else [])
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        held.clear()
        for h in handles:
            h.remove()


def saved_bytes(fn: Callable[[], torch.Tensor], exclude: list[torch.Tensor] | tuple = ()) -> int:
    """Bytes of distinct storages saved for backward while ``fn()`` runs (torch.autograd.graph hooks).
    Storages of ``exclude`` (e.g. a model's parameters, which exist anyway) are not counted."""
    into: dict[str, int] = {}
    with charged(into, exclude):
        fn()
    return sum(into.values())
