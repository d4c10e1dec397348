"""A piecewise activation as smooth pieces: the kinks of an expression in x (where a Max or Min switches
argument, an Abs or Heaviside argument or a select condition crosses 0), and on each interval between kinks the
smooth expression it equals there (each switch resolved at a point inside). ELU = Max(0, x) + Min(0, eˣ − 1): a kink
at 0, pieces eˣ − 1 on (−∞, 0) and x on (0, ∞).
"""

from __future__ import annotations

import functools
import math

import sympy as sp

from .functions import select

__all__ = ["inside", "kinks", "piece", "pieces", "sharpen", "x"]


#: The activations' variable (a sympy symbol is its name and assumptions: this is activations.x).
x = sp.Symbol("x", real=True)

#: The switching functions and where each switches: the argument differences that cross 0.
_SWITCHES = (sp.Max, sp.Min, sp.Abs, sp.Heaviside, select)


def _crossings(e: sp.Expr) -> list[sp.Expr]:
    if isinstance(e, sp.Max | sp.Min):
        return [a - b for i, a in enumerate(e.args) for b in e.args[i + 1:]]
    return [e.args[0]]  # Abs(u), Heaviside(u), select(c, a, b): u, c


def kinks(expr: sp.Expr) -> list[float]:
    """The real x, sorted, where a switch in ``expr`` changes branch (a ValueError when sympy cannot find them in
    closed form, or finds infinitely many). Solved once per expression (parsing checks them, the fits read them)."""
    return list(_kinks(expr))


@functools.lru_cache(maxsize=256)
def _kinks(expr: sp.Expr) -> tuple[float, ...]:
    found: set[float] = set()
    for e in sp.preorder_traversal(expr):
        if not isinstance(e, _SWITCHES):
            continue
        for u in _crossings(e):
            roots = sp.solveset(sp.Eq(u, 0), x, domain=sp.S.Reals)
            if roots is sp.S.EmptySet:
                continue
            if not isinstance(roots, sp.FiniteSet):
                raise ValueError(f"{e}: where {u} = 0 is not a finite set sympy can solve ({roots})")
            found |= {float(r) for r in roots}
    return tuple(sorted(found))


def inside(lo: float, hi: float) -> float:
    """A point strictly inside (lo, hi), either end possibly infinite: the middle, else 1 from the finite end."""
    if math.isfinite(lo) and math.isfinite(hi):
        return (lo + hi) / 2
    return hi - 1 if math.isfinite(hi) else lo + 1 if math.isfinite(lo) else 0.0


def piece(expr: sp.Expr, at: float, var: sp.Symbol = x) -> sp.Expr:
    """The smooth expression ``expr`` equals near ``var`` = ``at`` (not a kink): every switch resolved there."""
    def value(u):
        return float(u.subs(var, at))

    def resolve(e):
        if isinstance(e, sp.Max | sp.Min):
            pick = max if isinstance(e, sp.Max) else min
            return pick(e.args, key=value)
        if isinstance(e, sp.Abs):
            return e.args[0] if value(e.args[0]) >= 0 else -e.args[0]
        if isinstance(e, sp.Heaviside):
            return sp.Integer(1 if value(e.args[0]) > 0 else 0)
        return e.args[1] if value(e.args[0]) > 0 else e.args[2]  # select(c, a, b)
    return expr.replace(lambda e: isinstance(e, _SWITCHES), resolve)


def pieces(expr: sp.Expr) -> list[tuple[float, float, sp.Expr]]:
    """(lo, hi, smooth expression) for each interval between the kinks of ``expr``, left to right (one piece,
    (−∞, ∞), for a smooth expression)."""
    edges = [-math.inf, *kinks(expr), math.inf]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        out.append((lo, hi, piece(expr, inside(lo, hi))))
    return out


def sharpen(expr: sp.Expr) -> sp.Expr:
    """``expr`` with each Heaviside(u) whose u has one simple real root r written H(±(x − r)): the derivative of
    Min(0, eˣ − 1) is eˣ·H(1 − eˣ), whose argument cancels to 0 for |x| < 1e-16 in float64 (and for |x| < 1e-60
    at 60 digits), giving H(0) = ½ there; H(−x) has no such cancellation."""
    def simple(h):
        u = h.args[0]
        roots = sp.solveset(sp.Eq(u, 0), x, domain=sp.S.Reals)
        if not (isinstance(roots, sp.FiniteSet) and len(roots) == 1):
            return h
        r = next(iter(roots))
        slope = sp.diff(u, x).subs(x, r)
        if not slope.is_real or slope == 0:
            return h
        return sp.Heaviside((x - r) if slope > 0 else (r - x), *h.args[1:])
    return expr.replace(lambda e: isinstance(e, sp.Heaviside) and e.args[0] != x, simple)
