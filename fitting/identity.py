"""Exact inverted-activation tables proven exact (``approxbp certify``): sympy shows q(f(x)) − f′(x) ≡ 0, for a
smooth table by ``simplify`` (or modulo the relations s² = A of its square roots), for a piecewise one on each of
its smooth pieces. Only the float32 evaluation is then left to bound."""

from __future__ import annotations

import math

import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations.activations import x as X_SYMBOL
from approxbp.approximations.invact_forms import Form
from approxbp.approximations.invact_forms import y as FORM_Y
from approxbp.approximations.pieces import inside, piece, pieces

__all__ = ["identity_proof"]


def _piece_identity(act, q: sp.Expr, lo: float, hi: float, f: sp.Expr) -> bool:
    """q(f(x)) − f′(x) ≡ 0 on one smooth piece (lo, hi) of a piecewise increasing activation: q's selects resolved at
    the piece's y (f increases, so the piece's x map to its y alone), x written lo + s or hi − s with s > 0. At a kink
    itself f′ is the mean of its one-sided values (H(0) = ½), which a C¹ kink (ELU's) makes the same value."""
    s = sp.Symbol("s", positive=True)
    xs = lo + s if math.isfinite(lo) else hi - s if math.isfinite(hi) else sp.Symbol("x", real=True)
    here = piece(q, float(act.f(inside(lo, hi))), FORM_Y)
    fx = f.subs(X_SYMBOL, xs)
    return sp.simplify(here.subs(FORM_Y, fx) - sp.diff(f, X_SYMBOL).subs(X_SYMBOL, xs)) == 0


def identity_proof(t, branch: str) -> bool:
    """Whether sympy proves q(f(x)) − f′(x) ≡ 0 on a derived (closed-form) table's branch (x < T left, x > T right,
    every x for a monotone table): ``simplify``, else each √A made a symbol s with s² = A and the numerator reduced
    modulo those relations (squareplus: q = y²/(y² + 1) at y = (x + s)/2, s² = x² + 4). False: not proven."""
    if t.source != "derived":
        return False
    act = get_activation(t.expression)
    if t.monotone and len(parts := pieces(act.expr)) > 1:
        q = Form.from_table(getattr(t, branch)).full()
        return all(_piece_identity(act, q, *part) for part in parts)
    xs = sp.Symbol("x", real=True) if t.monotone else sp.Symbol("x", negative=branch == "left",
                                                                 positive=branch == "right")
    shift = 0 if t.monotone else t.turning_point
    f = act.expr.subs(X_SYMBOL, xs + shift)
    e = Form.from_table(getattr(t, branch)).full().subs(FORM_Y, f) - sp.diff(f, xs)
    if sp.simplify(e) == 0:
        return True
    roots = {p.base: sp.Symbol(f"s{i}", positive=True)
             for i, p in enumerate(e.atoms(sp.Pow)) if abs(p.exp) == sp.S.Half}
    num = sp.expand(sp.numer(sp.together(e.xreplace({sp.sqrt(a): s for a, s in roots.items()}
                                                    | {1 / sp.sqrt(a): 1 / s for a, s in roots.items()}))))
    for a, s in roots.items():
        num = sp.expand(sp.rem(num, s**2 - a, s))
    return num == 0
