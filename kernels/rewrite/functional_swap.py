"""Activations called as functions (``F.gelu(x)``, ``F.silu(x)``, a module-level Hugging Face activation such as
RoBERTa's LM-head ``gelu``) swapped where they run. The module that calls one gets a forward pre-hook that enters a
torch function mode for the length of its own call, and a forward hook (always called) that leaves it; the mode
answers that activation's calls made in the module itself — not in its submodules (each counts itself running by
its own hooks), which are swapped or left on their own terms — with the drop-in of its table, checked against
torch's function on a float64 grid as a module swap is. The forward value is torch's (every drop-in's forward is
exact); only what is saved for backward changes. Under ``torch.compile`` the hooks stand aside and the stock
function runs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import swaps
from .glu_forms import functional_activation

__all__ = ["install", "installed", "STOCK", "uninstall"]


#: Where a module keeps its call-site drop-ins ({activation: drop-in}; in ``__dict__``: not submodules, no state).
_KEY = swaps.CALL_SITE

#: The torch module computing each activation function, for the table lookup and the float64 check.
STOCK = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU, "mish": nn.Mish}


def _in_place(args, kwargs) -> bool:
    return bool((kwargs or {}).get("inplace", False) or (len(args) > 1 and args[1] is True))


class _Site:
    """One owner's call-site swap, kept in its ``__dict__``: the drop-ins, the modes of its calls under way
    (innermost last) and how many of its submodules are running (their own hooks count them: no hook of the whole
    process, no state outside the model)."""

    def __init__(self, dropins: dict):
        self.dropins, self.calls, self.depth = dropins, [], 0


class _CallSite(TorchFunctionMode):
    """Within one call of the owner: its own calls of a swapped activation go to the drop-in (an in-place call stays
    torch's: the caller may read its input afterwards); a call made inside one of its submodules is left alone."""

    def __init__(self, site: _Site):
        super().__init__()
        self.site = site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        act = functional_activation(func, args, kwargs) if self.site.depth == 0 else None
        new = self.site.dropins.get(act) if act is not None and not _in_place(args, kwargs) else None
        return new(args[0]) if new is not None else func(*args, **(kwargs or {}))


def _enter(owner: nn.Module, args) -> None:
    site = owner.__dict__.get(_KEY)
    if torch.compiler.is_compiling() or site is None:
        return
    mode = _CallSite(site)
    mode.__enter__()
    site.calls.append(mode)


def _leave(owner: nn.Module, args, out) -> None:
    site = owner.__dict__.get(_KEY)
    if site is not None and site.calls:
        site.calls.pop().__exit__(None, None, None)


def _inner_enter(site: _Site, module, args) -> None:
    site.depth += bool(site.calls)


def _inner_leave(site: _Site, module, args, out) -> None:
    site.depth -= bool(site.calls) and site.depth > 0


def install(owner: nn.Module, dropins: dict) -> None:
    """Swap ``owner``'s own calls of each activation in ``dropins`` ({activation: drop-in module}): a pre-hook and
    an always-called hook on ``owner`` enter and leave the mode; each submodule's own pair counts it running."""
    site = owner.__dict__[_KEY] = _Site(dropins)
    owner.register_forward_pre_hook(_enter)
    owner.register_forward_hook(_leave, always_call=True)
    for m in owner.modules():
        if m is not owner:
            m.register_forward_pre_hook(functools.partial(_inner_enter, site))
            m.register_forward_hook(functools.partial(_inner_leave, site), always_call=True)


def _ours(hook) -> bool:
    return hook in (_enter, _leave) or (isinstance(hook, functools.partial) and hook.func in (_inner_enter,
                                                                                           _inner_leave))


def uninstall(owner: nn.Module) -> None:
    """Undo :func:`install` (the hooks found by what they are: a deep copy of the model has its own)."""
    if owner.__dict__.pop(_KEY, None) is None:
        return
    for m in owner.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks):
            for k in [k for k, h in table.items() if _ours(h)]:
                del table[k]
                m._forward_hooks_always_called.pop(k, None)  # torch_private.MODULE_HOOK_TABLES


def installed(owner: nn.Module) -> dict:
    """The call-site drop-ins of ``owner`` ({} when none)."""
    site = owner.__dict__.get(_KEY)
    return site.dropins if site is not None else {}
