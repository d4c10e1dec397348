"""0.1 names kept working with a DeprecationWarning, in every layer (fitting and kernels import this module)."""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """One DeprecationWarning: ``old`` is deprecated, use ``new``."""
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=stacklevel)


def callable_module(module_name: str, fn: Callable, old: str, new: str) -> None:
    """Make the module ``module_name`` callable as ``fn`` (with a DeprecationWarning naming ``new``): where 0.1
    exported a function under the name a module now holds, ``import pkg.name as m`` gives the module, and the old
    call ``pkg.name(...)`` still works."""
    def __call__(self, *args, **kwargs):
        warn_renamed(old, new)
        return fn(*args, **kwargs)

    module = sys.modules[module_name]
    module.__class__ = type("CallableModule", (types.ModuleType,), {"__call__": __call__, "__doc__": module.__doc__})
