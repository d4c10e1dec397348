"""One record per table family. A family is what a table's ``"family"`` names; each layer keeps
its part of the family in a registry keyed by that name, filled by the family's own modules:

    approximations   :data:`TABLE_FAMILIES`: the typed table, its schema checks, its gradient error (this module)
    kernels          ``kernels.modules.FAMILIES``: its ``Spec`` (the drop-in module, its error said once);
                     ``kernels.codegen.RENDERERS``: its Triton module
    fitting          ``fitting.certify.CERTIFIERS``: its rigorous certificate and which tables get one
    top              ``approxbp.cost.LAUNCHES``: its kernels' launches, for the static cost

:func:`member` is the one lookup every layer uses: a family a layer does not know is refused by name, never served by
another family's branch. Adding a family is one module per layer registering its part (``tests/test_families.py``
adds a toy family that way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["lazy", "member", "register", "TABLE_FAMILIES", "TableFamily"]


@dataclass(frozen=True)
class TableFamily:
    """This layer's part of a family: its typed table (a ``tables._Table``), the checks of its own fields and of its
    ``metrics.certified`` (each raising ``TableError`` via ``table_schema.fail``), its gradient-error bound of a
    loaded table, and what that bound means (for reports)."""

    name: str
    table_class: type
    validate: Callable[[dict, str], None]
    check_certified: Callable[[dict, str], None]
    gradient_error: Callable[[object], float]
    error_meaning: str


#: family name → its record, filled by :func:`register` (the built-in ``relu-sum`` and ``invact``: ``tables.py``).
TABLE_FAMILIES: dict[str, TableFamily] = {}


def register(registry: dict, name: str, entry):
    """``registry[name] = entry`` (a family registering a layer's part of itself); returns ``entry``."""
    registry[name] = entry
    return entry


def member(registry: dict, name: str, what: str):
    """``registry[name]``, or a KeyError naming ``what`` is missing for the family and the families known."""
    try:
        return registry[name]
    except KeyError:
        raise KeyError(f"no {what} for table family {name!r}; known: {', '.join(sorted(registry)) or 'none'}") from None


def lazy(module: str, name: str) -> Callable:
    """``module.name`` imported at its first call (``module`` absolute, e.g. ``approxbp.approximations.table_checks``):
    a family's entry whose code is on the build side (sympy, scipy) costs the run time nothing until used."""
    def call(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{module}.{name}"
    return call
