"""Exact inverted-activation tables derived in closed form (Inverted Activations §2): for a piecewise
activation that is flat left of T = 0 and strictly increasing right of it, f′(f⁻¹(y)) has one value per y,

    q(y) = 0 on the left branch (f′ = 0 there),   q(y) = f_r′(f_r⁻¹(y)) on the right (sympy ``solve``),

e.g. ReLU²: f = max(0, x)², q = 2√y. An activation increasing everywhere with inf f = 0 (softplus, squareplus) has
one branch: q(y) = f′(f⁻¹(y)) from y alone, no bit at all (a ``monotone`` table). No fit and no approximation: the
backward is exact to rounding. The table's metrics are measured, not assumed: q against f′(f⁻¹(y)) with f⁻¹ found
by mpmath's root finder at 60 digits.
"""

from __future__ import annotations

import time

import mpmath
import numpy as np
import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.activations import named_expression, x
from approxbp.approximations.backends import numpy_namespace
from approxbp.approximations.functions import select
from approxbp.approximations.invact_forms import Form
from approxbp.approximations.pieces import inside, pieces
from approxbp.approximations.table_checks import MONOTONE_SPAN, UNBOUNDED_BELOW, not_increasing_at

from .relu_sum import package_version

__all__ = ["derive_exact", "derive_monotone", "exact_table", "infimum", "is_monotone", "measured", "monotone_table",
           "NoClosedForm", "RIGHT_SPAN", "supremum", "takes_exact"]


#: Where the right branch is checked: y from 1e-12 to 1e4, log-spaced (and the left branch on x ∈ [−10, 0)).
_CHECK_POINTS = 201
RIGHT_SPAN = 1e4


class NoClosedForm(ValueError):
    """An increasing activation whose inverse sympy cannot write in closed form, with the ways forward: the fitted
    one-branch form (``fitted``: where it applies, fitting.invact_fitted.takes_fitted) and the ReLU-sum fit."""

    def __init__(self, reason: str, act, fitted: bool = False):
        self.reason, self.activation = reason, act
        newton = (f"{act.fit_command('invact', '--form newton')} (a fitted one-branch form: Newton steps from a "
                  "fitted guess), or " if fitted else "")
        super().__init__(f"{reason}. A way forward: {newton}{act.relu_sum_way_forward()}")


def derive_exact(activation: str) -> tuple[sp.Expr, sp.Expr]:
    """(f on the right, q(y) = f′(f⁻¹(y)) on the right) for an activation flat left of 0 and increasing right of it;
    a ValueError with the reason for any other."""
    act = get_activation(activation)
    pos, neg = sp.Symbol("xp", positive=True), sp.Symbol("xn", negative=True)
    left, right = act.expr.subs(x, neg), act.expr.subs(x, pos)
    if left.free_symbols or sp.sympify(left - act.expr.subs(x, 0)) != 0:
        raise ValueError(f"{act.name}: an exact table needs f increasing, or constant for x < 0 and continuous at 0; "
                         f"left of 0 it is {left}. A way forward: {act.fit_command('invact')} (the fitted two-branch "
                         f"forms, for an f with one minimiser), or {act.relu_sum_way_forward()}")
    y = sp.Symbol("y", positive=True)
    roots = sp.solve(sp.Eq(right, y), pos)
    if len(roots) != 1:
        raise ValueError(f"{act.name}: f = {right} for x > 0 has {len(roots)} inverses in closed form, not one")
    q = sp.simplify(sp.diff(right, pos).subs(pos, roots[0]))
    if sp.limit(sp.diff(right, pos), pos, 0, "+") != 0:
        raise ValueError(f"{act.name}: f′ jumps at 0, so the branch bit would be needed at y = f(0)")
    return right.subs(pos, x), q.subs(y, sp.Symbol("y"))


def is_monotone(act) -> bool:
    """h′ > 0 wherever the tables check it (:func:`~approxbp.approximations.table_checks.not_increasing_at`)."""
    return not_increasing_at(act) is None


def _constant(f: sp.Expr) -> bool:
    """A smooth piece that is constant (f′ ≡ 0: ReLU6's 0 and 6)."""
    return sp.diff(f, x) == 0


def _is_saturating(act) -> bool:
    """Non-decreasing piece by piece, with constant pieces (ReLU6, hard-sigmoid, hard-tanh): every smooth piece is
    constant or increasing on a grid inside it, at least one of each, and f is continuous at the kinks. A saved y
    still gives f′: the constant pieces' values are taken by no increasing piece, so q = 0 there."""
    act = get_activation(act)
    parts = pieces(act.expr)
    flat = [_constant(f) for _, _, f in parts]
    if len(parts) < 2 or all(flat) or not any(flat):
        return False
    with np.errstate(all="ignore"):
        for (lo, hi, _), constant in zip(parts, flat, strict=True):
            a, b = max(lo, -MONOTONE_SPAN), min(hi, MONOTONE_SPAN)
            if not constant and not np.all(act.df(np.linspace(a, b, 203)[1:-1]) > 0):
                return False
        kinks = np.array([hi for _, hi, _ in parts[:-1]])
        return bool(np.allclose(act.f(kinks - 1e-9), act.f(kinks + 1e-9), rtol=1e-6, atol=1e-6))


def _flat_then_increasing(act) -> bool:
    """Constant left of 0, increasing right of it (ReLU²): the two-branch table of :func:`derive_exact` serves it
    (its packaged table; the one-branch form would serve it too, without the bit)."""
    parts = pieces(act.expr)
    return len(parts) == 2 and parts[0][1] == 0.0 and _constant(parts[0][2])


def takes_exact(act) -> bool:
    """Whether ``act`` is served by an exact table (``form="auto"`` picks it): increasing everywhere, or
    non-decreasing with constant pieces (one branch, no bit), or flat left of 0 and increasing right of it
    (ReLU²)."""
    act = get_activation(act)
    return is_monotone(act) or _is_saturating(act)  # ReLU² is one of the latter


def infimum(activation, unbounded: bool = False) -> float:
    """inf f = lim f as x → −∞ of an increasing activation (sympy's limit of its leftmost smooth piece): 0 for
    softplus, −1 for ELU; for f → −∞, :data:`UNBOUNDED_BELOW` with ``unbounded`` (the exact one-branch form needs
    no floor: q holds for every y), else a ValueError (a fitted form's window starts at the floor)."""
    act = get_activation(activation)
    limit = sp.limit(pieces(act.expr)[0][2], x, -sp.oo)
    if unbounded and limit == -sp.oo:
        return UNBOUNDED_BELOW
    if not (limit.is_real and limit.is_finite):
        raise ValueError(f"{act.name}: f → {limit} as x → −∞; an inverted activation needs a finite infimum")
    return float(limit)


def derive_monotone(activation) -> sp.Expr:
    """q(y) = f′(f⁻¹(y)) for an increasing activation with a finite infimum (softplus: 1 − e^(−y); squareplus
    (x + √(x² + 4))/2: y²/(y² + 1); ELU: select(y, 1, y + 1), one closed form per smooth piece joined at the
    kinks' y), by sympy ``solve`` on each piece; a ValueError with the reason when a piece has no such closed form.
    One branch: the saved output alone gives the gradient, no bit (Inverted Activations §2)."""
    return _derived_monotone(get_activation(activation))[0]


def _derived_monotone(act) -> tuple[sp.Expr, float]:
    """(q, inf f) of :func:`derive_monotone`, derived once for the table that records both. A constant piece of
    value c (:func:`_is_saturating`) gives q(c) = 0: the join at its kink sends y = c to it, whichever side it is on
    (select(u, a, b) is a for u > 0, else b)."""
    if not (is_monotone(act) or _is_saturating(act)):
        raise ValueError(f"{act.name}: not increasing on [−{MONOTONE_SPAN:g}, {MONOTONE_SPAN:g}] (nor non-decreasing "
                         "with constant pieces)")
    floor, y = infimum(act, unbounded=True), sp.Symbol("y")
    q, right_flat = None, False
    for lo, hi, f in reversed(pieces(act.expr)):
        flat = _constant(f)
        here = sp.Integer(0) if flat else _piece_slope(act, f, lo, hi, floor)
        if q is not None:
            c = float(act.f(hi))  # y at the kink
            q = select(c - y, here, q) if right_flat else select(y - c, q, here)  # y = c: to the constant piece
        else:
            q = here
        right_flat = flat
    return q, floor


def _piece_slope(act, f: sp.Expr, lo: float, hi: float, floor: float) -> sp.Expr:
    """f′(f⁻¹(y)) on one smooth piece of an increasing activation, in y, from the one real inverse that maps back."""
    if np.isfinite(lo):
        low = float(act.f(lo))
    else:  # the leftmost piece: from the floor, or (unbounded below) from far left on it
        low = floor if floor != UNBOUNDED_BELOW else float(act.f(min(-MONOTONE_SPAN, hi - MONOTONE_SPAN)))
    xr, y = sp.Symbol("x", real=True), sp.Symbol("y", positive=True) if low >= 0 else sp.Symbol("y", real=True)
    f = f.subs(x, xr)
    at = inside(lo, hi)
    probe = float(act.f(at))
    try:
        solved = sp.solve(sp.Eq(f, y), xr)
    except NotImplementedError:  # e^x + e^(√2·x): sympy has no algorithm for it
        solved = []
    roots = [r for r in solved if not r.has(sp.Piecewise)  # conditional roots: no closed form
             and abs(complex(sp.N(r.subs(y, probe))) - at) < 1e-9 * (1 + abs(at))]
    if len(roots) != 1:
        raise NoClosedForm(f"{act.name}: sympy finds {len(roots)} real inverses of y = {f} in closed form on "
                           f"({lo:g}, {hi:g}), not one", act)
    q = sp.diff(f, xr).subs(xr, roots[0])
    q = sp.simplify(q.replace(lambda e: e.is_Pow and abs(e.exp) == sp.S.Half,  # √((y²+1)²/y²) = (y²+1)/y
                              lambda e: sp.factor(sp.together(e.base)) ** e.exp))
    top = float(act.f(hi)) if np.isfinite(hi) else low + RIGHT_SPAN
    grid = low + np.geomspace(1e-12, max(top - low, 1e-12), 97)
    for form in (sp.factor_terms(sp.expand(q)), q):  # (e^(y²) − 1)·e^(−y²) overflows; 1 − e^(−y²) does not
        with np.errstate(all="ignore"):
            values = np.broadcast_to(sp.lambdify(y, form, numpy_namespace())(grid), grid.shape)
        if np.all(np.isfinite(values)):
            return form.subs(y, sp.Symbol("y"))
    raise ValueError(f"{act.name}: q(y) = {q} is not finite in float64 on ({low:g}, {top:g})")


def supremum(act) -> float:
    """sup f = lim f as x → +∞ (the rightmost smooth piece's), inf when it grows without bound."""
    limit = sp.limit(pieces(act.expr)[-1][2], x, sp.oo)
    return float(limit) if limit.is_real and limit.is_finite else float("inf")


def _y_base(act, floor: float) -> float:
    """Where a monotone table's checked y-range starts: inf f, or f(0) for an f unbounded below."""
    return float(act.f(0.0)) if floor == UNBOUNDED_BELOW else floor


def measured(activation, q, left: bool = True, floor: float = 0.0) -> dict:
    """L∞ and L2 of q (a sympy expression in y, or a float64 callable) against f′(f⁻¹(y)) (f⁻¹ by mpmath at 60
    digits, bracketed) for y from ``floor`` + 1e-12 to ``floor`` + RIGHT_SPAN, or to just below sup f, where q at the
    constant pieces' values (0) is checked too; with ``left``, f′ on the left of 0 (q = 0 there)."""
    act = get_activation(activation)
    q_of = sp.lambdify(sp.Symbol("y"), q, numpy_namespace()) if isinstance(q, sp.Basic) else q  # its select
    top = supremum(act) if not left else float("inf")
    base = _y_base(act, floor)
    span = min(RIGHT_SPAN, (top - base) * (1 - 1e-9))
    ys = base + np.logspace(-12, np.log10(span), _CHECK_POINTS)
    if floor == UNBOUNDED_BELOW:  # below f(0) too, down to f(0) − RIGHT_SPAN
        ys = np.concatenate([base - np.logspace(np.log10(RIGHT_SPAN), -12, _CHECK_POINTS), ys])

    def f_minus(yv):
        return lambda t: act.mp(t, 0, None) - yv

    constants = [] if left else [float(f) for _, _, f in pieces(act.expr) if _constant(f)]
    errors = [abs(float(q_of(c))) for c in constants]  # f′ = 0 on the constant pieces
    with mpmath.workdps(60), np.errstate(invalid="ignore"):  # select evaluates both pieces: √y at y < 0 is NaN
        for yv in ys:
            lo, hi = mpmath.mpf(0 if left else -1), mpmath.mpf(1)
            while f_minus(yv)(lo) > 0:  # a monotone activation's inverse of a small y lies far left (−1e12)
                lo *= 2
            while f_minus(yv)(hi) < 0:  # the tightest power of 2 above: eˣ at 2y would need 10⁴ digits
                hi *= 2
            root = mpmath.findroot(f_minus(yv), (lo, hi), solver="illinois", maxsteps=500)
            errors.append(abs(float(q_of(yv)) - float(act.mp(root, 1, None))))
        flat = [abs(float(act.mp(mpmath.mpf(v), 1, None))) for v in np.linspace(-10, -1e-12, _CHECK_POINTS)]
    right = np.array(errors)
    out = {"linf_right": float(right.max()), "l2_right": float(np.sqrt(np.mean(right**2)))}
    return {"linf_left": max(flat), "l2_left": float(np.sqrt(np.mean(np.square(flat)))), **out} if left else out


def exact_table(activation: str) -> table_files.InvActTable:
    """The exact invact table of ``activation`` (form ``exact``, source ``derived``): q = 0 on the left branch, the
    derived q(y) on the right, and the combined q(y, b) the kernels evaluate; for an increasing activation one
    branch and no bit (:func:`monotone_table`)."""
    t0 = time.perf_counter()
    act = get_activation(activation)
    if is_monotone(act) or (_is_saturating(act) and not _flat_then_increasing(act)):
        return monotone_table(act, t0)
    right_f, q = derive_exact(activation)
    zero, f_T = Form.parse("0*y"), float(act.f(0.0))
    right = Form.parse(str(q))
    combined = Form.parse(f"select(b - 0.5, 0, {q})", variables=("y", "b"))
    return table_files.InvActTable.new(
        act, source="derived", form="exact", turning_point=0.0, f_T=f_T,
        reference=f"derived: f = {right_f} for x > 0, f′(f⁻¹(y)) = {q}; f′ = 0 for x < 0 (Inverted Activations §2)",
        left=zero.to_json((f_T, f_T + 1.0)), right=right.to_json((f_T, f_T + RIGHT_SPAN)),
        combined=combined.to_json(), metrics=measured(activation, q),
        provenance=_provenance(f"approxbp fit invact --activation {act.name} --form exact", t0))


def monotone_table(activation, t0: float | None = None) -> table_files.InvActTable:
    """The one-branch exact table of an increasing activation, or a non-decreasing one with constant pieces:
    q(y) = f′(f⁻¹(y)) (:func:`derive_monotone`) on [0, RIGHT_SPAN], h′(y) beyond it like every invact table; no
    turning point and no branch bit."""
    t0 = time.perf_counter() if t0 is None else t0
    act = get_activation(activation)
    q, floor = _derived_monotone(act)
    metrics = measured(act, q, left=False, floor=floor)
    given = act.name if named_expression(act.name) else act.expression
    unbounded = floor == UNBOUNDED_BELOW
    return table_files.InvActTable.new(
        act, source="derived", form="exact", monotone=True, f_T=floor,
        reference=f"derived: f increasing with {'f → −∞ as x → −∞' if unbounded else f'inf f = {floor:g}'}, "
                  f"f′(f⁻¹(y)) = {q} (Inverted Activations §2: one branch, no bit)",
        right=Form.parse(str(q)).to_json((floor, _y_base(act, floor) + RIGHT_SPAN)), metrics=metrics,
        provenance=_provenance(f"approxbp fit invact --activation '{given}' --form exact", t0))


def _provenance(command: str, t0: float) -> dict:
    return {"method": "closed form (sympy solve), checked against mpmath at 30 digits", "seed": None,
            "command": command, "package_version": package_version(), "seconds": round(time.perf_counter() - t0, 3)}
