"""Activations called as functions (``F.gelu(x)``, ``F.silu(x)``, a module-level Hugging Face activation such as
RoBERTa's LM-head ``gelu``) swapped where they run. The module that calls one gets a forward pre-hook that enters a
torch function mode for the length of its own call, and a forward hook (always called) that leaves it; the mode
answers that activation's calls made in the module itself — not in its submodules, which are swapped or left on
their own terms — with the drop-in of its table, checked against torch's function on a float64 grid as a module
swap is. The forward value is torch's (every drop-in's forward is exact); only what is saved for backward changes.
Under ``torch.compile`` the hooks stand aside and the stock function runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from .glu_forms import functional_activation

__all__ = ["install", "installed", "STOCK", "uninstall"]


#: Where a module keeps its call-site drop-ins ({activation: drop-in}; in ``__dict__``: not submodules, no state).
_KEY = "_approxbp_call_site"

#: The torch module computing each activation function, for the table lookup and the float64 check.
STOCK = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU, "mish": nn.Mish}


def _in_place(args, kwargs) -> bool:
    return bool((kwargs or {}).get("inplace", False) or (len(args) > 1 and args[1] is True))


class _CallSite(TorchFunctionMode):
    """Within one call of ``owner``: its own calls of a swapped activation go to the drop-in (an in-place call stays
    torch's: the caller may read its input afterwards). ``depth`` counts the owner's submodules running (module
    hooks of the whole process while the mode is on)."""

    def __init__(self, owner: nn.Module, dropins: dict):
        super().__init__()
        self.dropins, self.depth = dropins, 0
        self.inner = {id(m) for m in owner.modules() if m is not owner}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        act = functional_activation(func, args, kwargs) if self.depth == 0 else None
        new = self.dropins.get(act) if act is not None and not _in_place(args, kwargs) else None
        return new(args[0]) if new is not None else func(*args, **(kwargs or {}))

    def enter(self, module, args):
        self.depth += id(module) in self.inner

    def leave(self, module, args, out):
        self.depth -= id(module) in self.inner


_ACTIVE: list = []  # (owner, mode, hook handles) of the calls under way, innermost last


def _enter(owner: nn.Module, args) -> None:
    if torch.compiler.is_compiling() or _KEY not in owner.__dict__:
        return
    mode = _CallSite(owner, owner.__dict__[_KEY])
    handles = (register_module_forward_pre_hook(mode.enter), register_module_forward_hook(mode.leave,
                                                                                         always_call=True))
    mode.__enter__()
    _ACTIVE.append((owner, mode, handles))


def _leave(owner: nn.Module, args, out) -> None:
    if _ACTIVE and _ACTIVE[-1][0] is owner:
        _, mode, handles = _ACTIVE.pop()
        mode.__exit__(None, None, None)
        for h in handles:
            h.remove()


def install(owner: nn.Module, dropins: dict) -> None:
    """Swap ``owner``'s own calls of each activation in ``dropins`` ({activation: drop-in module})."""
    owner.__dict__[_KEY] = dropins
    owner.register_forward_pre_hook(_enter)
    owner.register_forward_hook(_leave, always_call=True)


def uninstall(owner: nn.Module) -> None:
    """Undo :func:`install` (the hooks found by identity: a deep copy of the model has its own)."""
    if owner.__dict__.pop(_KEY, None) is None:
        return
    for table, fn in ((owner._forward_pre_hooks, _enter), (owner._forward_hooks, _leave)):
        for k in [k for k, h in table.items() if h is fn]:
            del table[k]
            owner._forward_hooks_always_called.pop(k, None)  # torch_private.MODULE_HOOK_TABLES


def installed(owner: nn.Module) -> dict:
    """The call-site drop-ins of ``owner`` ({} when none)."""
    return owner.__dict__.get(_KEY, {})
