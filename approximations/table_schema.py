"""The table schema ``approxbp.table/1``: its names and limits, the field readers that fail naming the file and the
field, and an InvAct branch. Sympy-free: the kernels' run time reads tables through it (semantic validation:
:mod:`.table_checks`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .families import TABLE_FAMILIES

__all__ = ["Branch", "branches_of", "CONSTRAINT_TOL", "fail", "finite", "floats", "FREE_LEVELS_SCHEMA", "kind",
           "LEVELS_RULES", "MAX_COEFFICIENTS", "MAX_TABLE_BYTES", "need", "number", "number_text", "OBJECTIVES",
           "PAPER_CONSTRAINT_TOL", "SCHEMA", "SOURCES", "TableError", "VOLATILE"]


SCHEMA = "approxbp.table/1"


#: What ``approxbp fit relu-sum --levels free`` writes (FewBit's family): a study result, never a kernel's table.
FREE_LEVELS_SCHEMA = "approxbp.free-levels/1"


#: How a ReLU-sum table's levels are constrained: eq13, Approx-BP's (ℓ₀ = 0, Σw = 1, Σw·c = 0: h̃ itself fits h),
#: or free, FewBit's (every level free: only h̃′ fits h′; ``approxbp fit relu-sum --levels free``). The kernels are
#: the same (codes → levels).
LEVELS_RULES = ("eq13", "free")


#: fit: fitted here; paper: a paper's published coefficients; derived: exact, derived from the expression in closed
#: form (``fitting.invact_exact``), with the derivation in ``reference``.
SOURCES = ("fit", "paper", "derived")


OBJECTIVES = ("primitive", "derivative")


#: |Σw − 1| and |Σw·c| allowed in a fitted relu-sum table.
CONSTRAINT_TOL = 1e-12


#: The same for a ``source: paper`` table: the papers print 4–6 significant digits (Approx-BP App. E.2's
#: ReGELU2-d coefficients give 7.9e-4).
PAPER_CONSTRAINT_TOL = 1e-3


#: Fields that describe how and when a table was made, not what it is: left out of
#: :func:`~approxbp.approximations.tables.definition_sha256`.
VOLATILE = ("created", "provenance")


#: The largest table file read (the packaged ones are under 20 KiB): a hostile file cannot make reading it slow.
MAX_TABLE_BYTES = 1 << 20


#: The most coefficients one InvAct form may name (the packaged forms have under 40).
MAX_COEFFICIENTS = 256


class TableError(ValueError):
    """A coefficient table failed validation; the message names the file and the field."""


def fail(where: str, field: str, msg: str):
    raise TableError(f"{where}: field {field!r}: {msg}")


def need(t: dict, field: str, types, where: str):
    if field not in t:
        fail(where, field, "missing")
    v = t[field]
    if not isinstance(v, types) or isinstance(v, bool):
        fail(where, field, f"expected {types}, got {type(v).__name__} {v!r:.80}")
    if isinstance(v, int | float) and float in (types if isinstance(types, tuple) else (types,)) and finite(v) is None:
        fail(where, field, f"not a finite float ({number_text(v)})")
    return v


def finite(v) -> float | None:
    """``v`` as a finite float64, or None: not a JSON number (a string, a bool), NaN, ±inf, or an integer too large
    for a float (JSON allows 10**400), which is checked before any arithmetic."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def number_text(v) -> str:
    """What a value that is not a finite float is, in a few words."""
    if isinstance(v, int) and not isinstance(v, bool):
        return f"an integer of about {int(v.bit_length() * 0.30103) + 1} digits, too large for a float"
    return f"{type(v).__name__} {v!r:.40}"


def floats(t: dict, field: str, where: str, n: int | None = None) -> np.ndarray:
    v = need(t, field, list, where)
    for i, e in enumerate(v):
        if finite(e) is None:
            fail(where, field, f"element {i} is not a finite float ({number_text(e)})")
    arr = np.asarray([float(e) for e in v], dtype=np.float64)
    if n is not None and arr.size != n:
        fail(where, field, f"expected {n} numbers, got {arr.size}")
    return arr


def number(v) -> bool:
    return finite(v) is not None


def kind(t: dict, where: str) -> str:
    """The schema this approxbp reads and a known family; returns the family."""
    schema = need(t, "schema", str, where)
    if schema == FREE_LEVELS_SCHEMA:
        fail(where, "schema", "a free-level (FewBit) fit written by an earlier approxbp as a study result: fit it "
              "again with `approxbp fit relu-sum --levels free … --out`, which now writes a ReLU-sum table "
              "(levels_rule: free) with kernels")
    if schema != SCHEMA:
        fail(where, "schema", f"unsupported schema {schema!r}; this approxbp reads {SCHEMA!r}")
    family = need(t, "family", str, where)
    if family not in TABLE_FAMILIES:
        fail(where, "family", f"unknown family {family!r}; known: {tuple(TABLE_FAMILIES)}")
    return family


@dataclass(frozen=True)
class Branch:
    """One InvAct q form: an expression in y (and b, for the combined form), its coefficients, the named
    intermediates assigned before it, the y-domain it was fitted on (None for the combined form) and its
    operation count."""

    expression: str
    coefficients: dict
    assignments: tuple = ()
    domain: tuple | None = None
    operations: int | None = None

    @classmethod
    def from_json(cls, d: dict) -> Branch:
        return cls(d["expression"], dict(d["coefficients"]), tuple(tuple(a) for a in d.get("assignments", ())),
                   tuple(d["domain"]) if "domain" in d else None, d.get("operations"))


def branches_of(t) -> tuple[str, ...]:
    """The branches an invact table (JSON or typed) holds: ("right",) for a monotone activation (one branch, no
    bit), else ("left", "right")."""
    return ("right",) if (t.get("monotone", False) if isinstance(t, dict) else t.monotone) else ("left", "right")
