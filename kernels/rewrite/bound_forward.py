"""A module's ``forward`` replaced by an object that holds the module, where a closure would capture it: a deep copy
of the model gets a forward that runs its copy (``copy.deepcopy`` copies the reference through its memo; a closure
is copied as itself and would run the original's parameters), and pickle / ``torch.save`` store it (its function
is a module-level one; a local closure cannot be pickled)."""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["BoundForward", "install_forward", "uninstall_forward"]


class BoundForward:
    """``fn(module, inner, *state, *args, **kwargs)`` as ``module.forward``; ``inner``: the forward it replaced
    (it gives this one its signature, which Trainer's column filter reads)."""

    def __init__(self, fn, module: nn.Module, inner, *state):
        self.fn, self.module, self.inner, self.state = fn, module, inner, state

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, self.inner, *self.state, *args, **kwargs)

    @property
    def __signature__(self):
        return inspect.signature(self.inner)


def install_forward(module: nn.Module, fn, *state) -> BoundForward:
    """``module.forward`` becomes ``BoundForward(fn, module, <its forward>, *state)``; returned, for
    :func:`uninstall_forward`."""
    bound = BoundForward(fn, module, module.forward, *state)
    module.forward = bound
    return bound


def uninstall_forward(module: nn.Module, bound: BoundForward | None) -> None:
    """Give ``module`` back the forward ``bound`` replaced (None: nothing was installed)."""
    if bound is None:
        return
    inner = bound.inner
    if getattr(inner, "__func__", None) is type(module).forward and inner.__self__ is module:
        module.__dict__.pop("forward", None)  # the class's own
    else:
        module.forward = inner
