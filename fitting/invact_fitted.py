"""A fitted one-branch InvAct form for an increasing activation whose inverse has no closed form: the
saved y still gives f′(f⁻¹(y)) with no bit (Inverted Activations §2), through a fitted initial guess and Newton steps,

    t = max(y − inf f, t₀),   w = t + log(−expm1(−t))   (= log(eᵗ − 1): ~log t as t → 0, ~t as t → ∞),
    x₀ = w + P((w − c)/r),   then damped Newton steps on f(x) = y (invact_forms.with_newton_steps),   q = f′(xₙ),

P a polynomial fitted by least squares to f⁻¹ − w on y ∈ [inf f + t₀, inf f + S]. Beyond S, q = h′(y), the tail rule
of every fitted table, for the smallest S where it errs by ≤ TOL/4 (x up to 10⁶). The degree and number of steps are
the cheapest (operations per element) whose L∞ on an x-grid (y = f(x), g = f′(x): no inversion) is ≤ TOL; the table's
metrics are then measured against mpmath's f⁻¹ at 60 digits, and ``approxbp certify`` propagates the steps' error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.activations import named_expression
from approxbp.approximations.backends import grammar, numpy_namespace
from approxbp.approximations.invact_forms import backward_rule, with_newton_steps
from approxbp.approximations.invact_forms import y as Y

from .invact_fast import TOL
from .relu_sum import package_version

__all__ = ["fitted_monotone_table", "STEPS", "takes_fitted", "Window"]


_T_MIN = 1e-12  # below inf f + t₀ the guess is held (q there is f′ ≤ f′(f⁻¹(t₀)), ~1e-11 for the tails we fit)
_SPANS = (16.0, 64.0, 256.0, 1024.0)
_DEGREES = (4, 6, 8, 10, 12, 14)
STEPS = (1, 2, 3)


def _bracket(act, target: float, start: float) -> float:
    """An x with f(x) on the far side of ``target`` from f(0), doubling from ``start`` (±1)."""
    xv = start
    with np.errstate(all="ignore"):
        while (act.f(np.array([xv]))[0] - target) * np.sign(start) < 0:
            xv *= 2
            if abs(xv) > 2.0**60:
                raise ValueError(f"{act.name}: f never reaches {target:g}")
    return xv


def _inverse(act, yv: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """f⁻¹(y) in float64 by bisection on [lo, hi] (f increasing), to the last bit (200 halvings)."""
    a, b = np.full(yv.shape, lo), np.full(yv.shape, hi)
    with np.errstate(all="ignore"):
        for _ in range(200):
            m = 0.5 * (a + b)
            below = act.f(m) < yv
            a, b = np.where(below, m, a), np.where(below, b, m)
    return 0.5 * (a + b)


def _tail_span(act, floor: float) -> float:
    """The smallest S in SPANS where q = h′(y) errs by ≤ TOL/4 for every y ≥ inf f + S (x sampled up to 10⁶)."""
    worst = {}
    for span in _SPANS:
        x_s = float(_inverse(act, np.array([floor + span]), -1.0, _bracket(act, floor + span, 1.0))[0])
        xv = np.concatenate([x_s + np.linspace(0.0, 50.0, 2001), np.geomspace(x_s + 50.0, 1e6, 200)])
        with np.errstate(all="ignore"):
            err = np.abs(act.df(act.f(xv)) - act.df(xv))
        worst[span] = float(np.max(np.where(np.isfinite(err), err, np.inf)))
        if worst[span] <= TOL / 4:
            return span
    err = worst[_SPANS[-1]]
    raise ValueError(
        f"{act.name}: beyond the fitted window the kernels use q = h′(y), which needs f′(f⁻¹(y)) → h′(y) as y → ∞ "
        f"(f(x) − x → 0); beyond y = {floor + _SPANS[-1]:g} " + (f"it errs by {err:.3g} > {TOL / 4:g}. "
                                                                 if np.isfinite(err) else "h′ overflows. ") +
        f"A way forward: {act.relu_sum_way_forward()}")


def _softplus_inverse(t):
    """w = log(eᵗ − 1) = t + log(−expm1(−t)), stable for every t > 0 (numpy or sympy)."""
    if isinstance(t, sp.Basic):
        return t + sp.log(-grammar("form")["expm1"](-t))
    return t + np.log(-np.expm1(-t))


@dataclass(frozen=True)
class Window:
    """The fit's samples, computed once per activation: 2001 points uniform in w on [inf f + t₀, inf f + S] with
    their x = f⁻¹(y) (bisection), the map z = (w − c)/r onto [−1, 1], and the x-grid the errors are measured on
    (6001 x from f⁻¹(inf f + t₀) to f⁻¹(inf f + 2S), and 200 more up to 20 left of it)."""

    floor: float
    span: float
    w: np.ndarray
    x: np.ndarray
    c: float
    r: float
    grid: np.ndarray

    @classmethod
    def of(cls, act, floor: float, span: float) -> Window:
        w_lo, w_hi = _softplus_inverse(_T_MIN), _softplus_inverse(span)
        left, right = _bracket(act, floor + _T_MIN, -1.0), _bracket(act, floor + 2 * span, 1.0)
        wv = np.linspace(w_lo, w_hi, 2001)
        xv = _inverse(act, floor + np.logaddexp(0.0, wv), left, right)
        lo, hi = _inverse(act, np.array([floor + _T_MIN, floor + 2 * span]), left, right)
        grid = np.concatenate([np.linspace(lo - 20.0, lo, 200), np.linspace(lo, hi, 6001)])
        return cls(floor, span, wv, xv, (w_lo + w_hi) / 2, (w_hi - w_lo) / 2, grid)


def _fitted_form(act, window: Window, degree: int, steps: int):
    """The Form for one degree and number of steps: P fitted by least squares in the Chebyshev basis on the
    window's samples, then written in powers of z = (w − c)/r for the kernels (Horner)."""
    c, r = window.c, window.r
    cheb = np.polynomial.Chebyshev.fit((window.w - c) / r, window.x - window.w, degree, domain=[-1, 1])
    power = np.polynomial.chebyshev.cheb2poly(cheb.coef)
    p = sp.symbols(f"p0:{degree + 1}")
    t = sp.Max(Y - sp.Float(window.floor, 17), sp.Float(_T_MIN, 17))
    w = _softplus_inverse(t)
    z = (w - sp.Float(c, 17)) / sp.Float(r, 17)
    guess = p[degree]
    for pi in reversed(p[:-1]):
        guess = guess * z + pi
    return with_newton_steps(act, w + guess, {pi.name: float(v) for pi, v in zip(p, power)}, steps)


def _rule(act, form, floor: float, span: float):
    """The kernels' q(y) for this form (invact_forms.backward_rule of a one-branch fitted table) in float64 numpy."""
    shape = SimpleNamespace(f_T=floor, combined=None, monotone=True, source="fit",
                            right=SimpleNamespace(domain=(floor, floor + span)))
    y, b = sp.symbols("y b")
    rule = sp.lambdify((y, b), backward_rule(shape), modules=[{"q_right": form, "activation_grad": act.df},
                                                               *numpy_namespace()])
    return lambda yv: np.broadcast_to(rule(np.asarray(yv, dtype=np.float64), 0.0), np.shape(yv))


def _grid_error(act, q, window: Window) -> float:
    """max |q(f(x)) − f′(x)| on the window's x-grid, in float64 (y = f(x), g = f′(x): no inversion)."""
    with np.errstate(all="ignore"):
        err = np.abs(q(act.f(window.grid)) - act.df(window.grid))
    return float(np.max(np.where(np.isfinite(err), err, np.inf)))


def _choose_form(act, floor: float, span: float, say=None):
    """The (form, grid L∞) with the fewest operations among DEGREES × STEPS whose grid L∞ is ≤ TOL; a ValueError
    naming the best reached when none is."""
    found, best, window = [], np.inf, Window.of(act, floor, span)
    for degree in _DEGREES:
        for steps in STEPS:
            form = _fitted_form(act, window, degree, steps)
            err = _grid_error(act, _rule(act, form, floor, span), window)
            best = min(best, err)
            (say or (lambda m: None))(f"degree {degree}, {steps} Newton step(s): grid L∞ {err:.3g}")
            if err <= TOL:
                found.append((form.operations(), err, form))
                break  # more steps only cost more at this degree
    if not found:
        raise ValueError(f"{act.name}: no fitted one-branch form (degree ≤ {_DEGREES[-1]}, ≤ {STEPS[-1]} Newton "
                         f"steps) reaches {TOL:g}; best {best:.3g}. A way forward: {act.relu_sum_way_forward()}")
    ops, err, form = min(found, key=lambda f: (f[0], f[1]))
    return form, err


def takes_fitted(act) -> bool:
    """Whether the fitted one-branch form applies: smooth, increasing, a finite infimum, and the tail rule holds
    beyond some window (:func:`_tail_span`)."""
    from .invact_exact import infimum, is_monotone

    act = get_activation(act)
    if act.kinks() or not is_monotone(act):
        return False
    try:
        _tail_span(act, infimum(act))
    except ValueError:
        return False
    return True


def fitted_monotone_table(activation, say=None) -> table_files.InvActTable:
    """The fitted one-branch table (form ``newton``, source ``fit``) of a smooth increasing activation with a
    finite infimum: no closed-form inverse needed."""
    from .invact_exact import infimum, is_monotone, measured

    t0, act = time.perf_counter(), get_activation(activation)
    if act.kinks() or not is_monotone(act):
        raise ValueError(f"{act.name}: the fitted one-branch form needs a smooth activation increasing everywhere; "
                         f"a way forward: {act.relu_sum_way_forward()}")
    try:
        floor = infimum(act)
    except ValueError as err:  # the fitted form's window starts at inf f; the exact form needs none
        raise ValueError(f"{err} (the fitted one-branch form's window starts there); a way forward: "
                         f"{act.fit_command('invact', '--form exact')} (one branch, no floor, "
                         f"where each piece has a closed-form inverse), or {act.relu_sum_way_forward()}") from None
    span = _tail_span(act, floor)
    form, grid_err = _choose_form(act, floor, span, say)
    metrics = measured(act, _rule(act, form, floor, span), left=False, floor=floor)
    given = act.name if named_expression(act.name) else act.expression
    steps = (len(form.assignments) - 1) // 2
    return table_files.InvActTable.new(
        act, source="fit", form="newton", monotone=True, f_T=floor,
        reference=f"fitted: f increasing with inf f = {floor:g} and no closed-form inverse; x₀ = w + P(z) of degree "
                  f"{len(form.coefficients) - 1}, {steps} Newton step(s), q = f′(xₙ) on [inf f, inf f + {span:g}], "
                  "h′(y) beyond (one branch, no bit)",
        right=form.to_json((floor, floor + span)), metrics={**metrics, "linf_grid": grid_err},
        provenance={"method": "least squares (numpy Chebyshev.fit) of f⁻¹ − w, Newton steps; measured against "
                              "mpmath at 60 digits", "seed": None,
                    "command": f"approxbp fit invact --activation '{given}' --form newton",
                    "package_version": package_version(), "seconds": round(time.perf_counter() - t0, 3)})
