"""One record per table family. A family is what a table's ``"family"`` names; each layer keeps
its part of the family in a :class:`Registry` keyed by that name, filled by the family's own modules:

    approximations   :data:`TABLE_FAMILIES`: the typed table, its schema checks, its gradient error (this module)
    kernels          ``kernels.modules.FAMILIES``: its ``Spec`` (the drop-in module, its planner options, its error
                     said); ``kernels.codegen.RENDERERS``: its Triton module
    fitting          ``fitting.certify.CERTIFIERS``: its rigorous certificate and which tables get one
    top              ``approxbp.cost.LAUNCHES``: its kernels' launches, for the static cost; ``commands.fit.FITS``: its
                     ``approxbp fit FAMILY`` subcommand

:func:`member` is the one lookup every layer uses: a family a layer does not know is refused by name, never served by
another family's branch. Adding a family is one module per layer registering its part. A family outside approxbp
(a user's package) names those modules as entry points, one group per registry (``Registry.group``, e.g.
``[project.entry-points."approxbp.codegen"] my-family = "my_package.codegen"``): a registry imports the module the
first time it is asked for that family or iterated, so each layer loads only its own part (the run time never
imports a family's code generator). ``tests/approximations/test_families.py`` adds a toy family that way, end to end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

__all__ = ["lazy", "member", "register", "Registry", "TABLE_FAMILIES", "TableFamily"]


class Registry(MutableMapping):
    """Family name → one layer's part of that family. Filled by the built-in families' modules on import
    (:func:`register`) and, for a family of another package, by the module its entry point of ``group`` names,
    imported when the family is first looked up (``registry[name]``, ``name in registry``) or the registry iterated."""

    def __init__(self, group: str):
        self.group = group
        self._entries: dict = {}
        self._looked: set[str] = set()  # entry-point names already imported (or found missing), each once

    def _load(self, name: str | None) -> None:
        """Import the modules that the installed packages' entry points of ``group`` name (``name``'s only, or
        every one); each registers its part when imported."""
        import sys

        for point in _entry_points(self.group, tuple(sys.path)):
            if point.name not in self._looked and name in (None, point.name):
                self._looked.add(point.name)
                point.load()

    def __getitem__(self, name: str):
        if name not in self._entries:
            self._load(name)
        return self._entries[name]

    def __setitem__(self, name: str, entry) -> None:
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        self._looked.discard(name)

    def __iter__(self):
        self._load(None)
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __repr__(self) -> str:
        return f"Registry({self.group!r}: {', '.join(self._entries)})"


@dataclass(frozen=True)
class TableFamily:
    """This layer's part of a family: its typed table (a ``tables.Table``), the checks of its own fields and of its
    ``metrics.certified`` (each raising ``TableError`` via ``table_schema.fail``), its gradient-error bound of a
    loaded table, and what that bound means (for reports)."""

    name: str
    table_class: type
    validate: Callable[[dict, str], None]
    check_certified: Callable[[dict, str], None]
    gradient_error: Callable[[object], float]
    error_meaning: str


#: family name → its record, filled by :func:`register` (the built-in ``relu-sum`` and ``invact``: ``tables.py``).
TABLE_FAMILIES: Registry = Registry("approxbp.tables")


@functools.lru_cache(maxsize=16)
def _entry_points(group: str, path: tuple[str, ...]) -> tuple:
    """The entry points of ``group`` installed on ``path`` (``sys.path``: scanned once per path, not per lookup)."""
    from importlib.metadata import entry_points

    return tuple(entry_points(group=group))


def register(registry: MutableMapping, name: str, entry):
    """``registry[name] = entry`` (a family registering a layer's part of itself); returns ``entry``."""
    registry[name] = entry
    return entry


def member(registry: MutableMapping, name: str, what: str):
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
