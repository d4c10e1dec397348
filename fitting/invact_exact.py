"""Exact inverted-activation tables derived in closed form (Inverted Activations §2, issue 32): for a piecewise
activation that is flat left of T = 0 and strictly increasing right of it, f′(f⁻¹(y)) has one value per y,

    q(y) = 0 on the left branch (f′ = 0 there),   q(y) = f_r′(f_r⁻¹(y)) on the right (sympy ``solve``),

e.g. ReLU²: f = max(0, x)², q = 2√y. No fit and no approximation: the backward is exact to rounding. The table's
metrics are measured, not assumed: q against f′(f⁻¹(y)) with f⁻¹ found by mpmath's root finder at 30 digits.
"""

from __future__ import annotations

import datetime as _dt
import time

import mpmath
import numpy as np
import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations import tables as T
from approxbp.approximations.activations import x
from approxbp.approximations.invact_forms import Form
from approxbp.approximations.tables import SCHEMA

from .relu_sum import package_version

#: Where the right branch is checked: y from 1e-12 to 1e4, log-spaced (and the left branch on x ∈ [−10, 0)).
CHECK_POINTS = 201
RIGHT_SPAN = 1e4


def derive_exact(activation: str) -> tuple[sp.Expr, sp.Expr]:
    """(f on the right, q(y) = f′(f⁻¹(y)) on the right) for an activation flat left of 0 and increasing right of it;
    a ValueError with the reason for any other."""
    act = get_activation(activation)
    pos, neg = sp.Symbol("xp", positive=True), sp.Symbol("xn", negative=True)
    left, right = act.expr.subs(x, neg), act.expr.subs(x, pos)
    if left.free_symbols or sp.sympify(left - act.expr.subs(x, 0)) != 0:
        raise ValueError(f"{act.name}: an exact table needs f constant for x < 0 and continuous at 0; left of 0 it is "
                         f"{left}")
    y = sp.Symbol("y", positive=True)
    roots = sp.solve(sp.Eq(right, y), pos)
    if len(roots) != 1:
        raise ValueError(f"{act.name}: f = {right} for x > 0 has {len(roots)} inverses in closed form, not one")
    q = sp.simplify(sp.diff(right, pos).subs(pos, roots[0]))
    if sp.limit(sp.diff(right, pos), pos, 0, "+") != 0:
        raise ValueError(f"{act.name}: f′ jumps at 0, so the branch bit would be needed at y = f(0)")
    return right.subs(pos, x), q.subs(y, sp.Symbol("y"))


def _measured(activation: str, q: sp.Expr) -> dict:
    """L∞ and L2 of q against f′(f⁻¹(y)) (f⁻¹ by mpmath at 30 digits) on the right; f′ on the left (q = 0)."""
    act = get_activation(activation)
    q_of = sp.lambdify(sp.Symbol("y"), q, "numpy")
    def mp_f(t):
        return act.mp(t, 0, None)

    def mp_df(t):
        return act.mp(t, 1, None)
    errors = []
    with mpmath.workdps(30):
        for yv in np.logspace(-12, np.log10(RIGHT_SPAN), CHECK_POINTS):
            root = mpmath.findroot(lambda t, yv=yv: mp_f(t) - yv, (mpmath.mpf(0), mpmath.mpf(2 * max(yv, 1))),
                                   solver="illinois", verify=False)
            errors.append(abs(float(q_of(yv)) - float(mp_df(root))))
        left = [abs(float(mp_df(mpmath.mpf(v)))) for v in np.linspace(-10, -1e-12, CHECK_POINTS)]
    right = np.array(errors)
    return {"linf_left": max(left), "l2_left": float(np.sqrt(np.mean(np.square(left)))),
            "linf_right": float(right.max()), "l2_right": float(np.sqrt(np.mean(right**2)))}


def exact_table(activation: str) -> T.InvActTable:
    """The exact invact table of ``activation`` (form ``exact``, source ``derived``): q = 0 on the left branch, the
    derived q(y) on the right, and the combined q(y, b) the kernels evaluate."""
    t0 = time.perf_counter()
    act = get_activation(activation)
    right_f, q = derive_exact(activation)
    zero, f_T = Form.parse("0*y"), float(act.f(0.0))
    right = Form.parse(str(q))
    combined = Form.parse(f"select(b - 0.5, 0, {q})", variables=("y", "b"))
    return T.from_json({
        "schema": SCHEMA, "family": "invact", "activation": act.name, "expression": act.expression,
        "created": _dt.date.today().isoformat(), "source": "derived", "form": "exact", "turning_point": 0.0,
        "f_T": f_T, "variable": "y",
        "reference": f"derived: f = {right_f} for x > 0, f′(f⁻¹(y)) = {q}; f′ = 0 for x < 0 (Inverted Activations §2)",
        "left": zero.to_json((f_T, f_T + 1.0)), "right": right.to_json((f_T, f_T + RIGHT_SPAN)),
        "combined": combined.to_json(), "metrics": _measured(activation, q),
        "provenance": {"method": "closed form (sympy solve), checked against mpmath at 30 digits", "seed": None,
                       "command": f"approxbp fit invact --activation {act.name} --form exact",
                       "package_version": package_version(), "seconds": round(time.perf_counter() - t0, 3)},
    })
