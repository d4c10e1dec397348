"""The ``fast`` inverted-activation form: g(y) = f′(f⁻¹(y)) at ≤ 1e-6 for two transcendental functions and a few
dozen fused operations per element, both branches together.

Near the turning point x − T is an analytic function of the *signed* root σ = ±√(y − f(T)) (+ right, − left;
y − f(T) = a₂δ² + a₃δ³ + … inverts to δ(σ)), so g is one analytic function G(σ) across both branches. Its nearest
singularity is the left branch's open end (σ → −√(−f(T)), x → −∞), so one rational minimax R(σ) = P(z)/Q(z), z
affine in σ, covers the left branch down to y₁ and the right branch up to Y_R, beyond which |g − 1| < 2e-7 and
q = 1. The left tail y ∈ (y₁, 0) is y·T(w) with w = log(−y) clamped below at w₀, where |g| < 2e-7: g/y is smooth
in log(−y) (GELU: g/y ≈ −x, x ≈ −√(−2w)). The whole form, with b = 1 on the left branch and 0 on the right:

    s = √max(y − f(T), 0);  z = (A − 2A·b)·s + B₀ (affine in σ = ±s);  R = P(z)/Q(z)
    w = max(log(max(−y, 1e-38)), w₀);  u = affine(w);  q = select(y − Y_R, 1, select(b·(y − y₁), y·T(u), R))

(w is held at w₀ beyond y₀, where |y·T| ≤ |g(y₀)| < 2e-7; extrapolating T there would grow like u^d).

Transcendentals: one √ and one log. Coefficients are fitted in float64 (linearised rational least squares,
refined by iteratively reweighted least squares towards minimax) and stored in the monomial basis of z ∈ [−1, 1].
"""

from __future__ import annotations

import numpy as np
import sympy as sp
from approxbp.approximations.functions import select
from approxbp.approximations.invact import InvertedActivation
from approxbp.approximations.invact_forms import Form, y
from numpy.polynomial import chebyshev as C
from scipy.optimize import least_squares

__all__ = ["b", "branch", "EVERY", "fast_form", "fused_operations", "NoFastForm", "rational", "TOL"]


TOL = 1e-6  # per-branch L∞ target, recorded in the table and asserted by the tests
_FIT_TOL = 3e-7  # what each piece is fitted to (margin for the pieces' joins and the grid)
_FLAT = 2e-7  # |g − 1| beyond Y_R and |g| beyond y₀, where the form returns 1 and ≈ 0
b = sp.Symbol("b")


class NoFastForm(ValueError):
    """The fast form cannot reach its tolerance for this activation; the message names the newton command."""

    def __init__(self, reason: str, activation):
        self.reason = reason
        super().__init__(f"{reason}; the newton form serves it: {activation.fit_command('invact', '--form newton')}")


def _g(ia: InvertedActivation, sig: np.ndarray) -> np.ndarray:
    yv = ia.f_T + sig * sig
    out = np.empty_like(yv)
    left = sig < 0
    out[left] = ia.g(yv[left], "left")
    out[~left] = ia.g(yv[~left], "right")
    return out


def _irls(fit, residual, n: int, rounds: int = 12):
    """Weighted fits with weights pushed towards the largest errors: an approximate minimax."""
    w = np.ones(n)
    best = None
    for _ in range(rounds):
        p = fit(np.sqrt(w))
        e = np.abs(residual(p))
        if best is None or e.max() < best[0]:
            best = (e.max(), p)
        w = w * (e / e.max() + 1e-3)
        w /= w.mean()
    return best


#: The rational fit's iterations run on every EVERY-th grid point (the errors are measured on all of them): a
#: degree ≤ 12 rational needs far fewer than the grid's 10 000 points, and each Levenberg–Marquardt step costs a
#: QR of the Jacobian (7× faster than the full grid, same degrees, errors within 4 %).
EVERY = 4


def rational(z: np.ndarray, g: np.ndarray, m: int, rounds: int = 12) -> tuple[float, np.ndarray, np.ndarray]:
    """(max error over the whole grid, P, Q) of a degree-(m, m) rational minimax fit P/Q on z ∈ [−1, 1]
    (Chebyshev coefficients, Q₀ = 1), fitted on every EVERY-th point in ``rounds`` IRLS rounds; error inf if Q
    changes sign on [−1, 1]."""
    zs, gs = z[::EVERY], g[::EVERY]
    Vp, Vq = C.chebvander(zs, m), C.chebvander(zs, m)[:, 1:]

    def res(p, sw):
        return sw * ((Vp @ p[: m + 1]) / (1.0 + Vq @ p[m + 1:]) - gs)

    def jac(p, sw):
        """∂r/∂P = sw·Vp/Q, ∂r/∂Q = −sw·Vq·P/Q² (exact: Levenberg–Marquardt needs no finite differences)."""
        a, b = Vp @ p[: m + 1], 1.0 + Vq @ p[m + 1:]
        return np.hstack([(sw / b)[:, None] * Vp, (-sw * a / (b * b))[:, None] * Vq])

    p0 = np.linalg.lstsq(np.hstack([Vp, -gs[:, None] * Vq]), gs, rcond=None)[0]

    def fit(sw, p=None):
        return least_squares(res, p0 if p is None else p, jac=jac, args=(sw,), method="lm", xtol=1e-15,
                             ftol=1e-15, max_nfev=400).x

    _, p = _irls(fit, lambda p: res(p, 1.0), zs.size, rounds=rounds)
    q = np.concatenate([[1.0], p[m + 1:]])
    err = float(np.max(np.abs(C.chebval(z, p[: m + 1]) / C.chebval(z, q) - g)))
    if np.min(C.chebval(np.linspace(-1, 1, 20001), q)) <= 0:
        err = np.inf
    return err, p[: m + 1], q


def _polyfit(u: np.ndarray, target: np.ndarray, d: int, weight: np.ndarray) -> tuple[float, np.ndarray]:
    """(max weighted error, Chebyshev coefficients) of a degree-d weighted minimax polynomial on u ∈ [−1, 1]."""
    V = C.chebvander(u, d)
    err, c = _irls(lambda sw: np.linalg.lstsq(V * (sw * weight)[:, None], target * sw * weight, rcond=None)[0],
                   lambda c: (V @ c - target) * weight, u.size, rounds=30)
    return err, c


def _first(fit, degrees):
    """(degree, *fit(degree)) for the lowest degree whose error is below FIT_TOL, or None."""
    for d in degrees:
        out = fit(d)
        if out[0] < _FIT_TOL:
            return (d, *out)
    return None


#: IRLS rounds of :func:`fast_form`'s cheap bound (a full fit takes 12).
_BOUND_ROUNDS = 4


def _horner(z: sp.Symbol, names: list[sp.Symbol]) -> sp.Expr:
    out = names[-1]
    for c in reversed(names[:-1]):
        out = c + z * out
    return out


def _cheap_bound(ia: InvertedActivation, center_grid, split: float, degree: int) -> None:
    """Refuse in one fit, not 24: the rational covers σ ∈ [−√(−p·f(T)), √(Y_R − f(T))], widest at the largest
    split p, so where the top degree misses FIT_TOL at the smallest split no split can reach it. A fit whose Q
    changes sign (error inf) bounds nothing (GELU's degree 12 has a spurious pole): then the search decides."""
    *_, z, gc = center_grid(split)
    if np.isfinite(top := rational(z, gc, degree, rounds=_BOUND_ROUNDS)[0]) and not top < _FIT_TOL:
        raise NoFastForm(f"no fast form reaches {_FIT_TOL:g} for {ia.activation.name!r}: the rational of degree "
                         f"{degree} misses it on the narrowest split ({split})", ia.activation)


def _left_tail(ia: InvertedActivation, y_zero: float, y1: float, degrees):
    """(w₀, w₁, the lowest-degree fit of g(y)/y in u, affine in w = log(−y) ∈ [w₁, w₀], or None)."""
    w0, w1 = np.log(-y_zero), np.log(-y1)
    wv = np.linspace(w1, w0, 6000)
    yv = -np.exp(wv)
    u = (2 * wv - (w0 + w1)) / (w0 - w1)
    target, weight = ia.g(yv, "left") / yv, np.abs(yv)
    return w0, w1, _first(lambda d: _polyfit(u, target, d, weight), degrees)


def fast_form(ia: InvertedActivation, splits=(0.6, 0.7, 0.8), degrees=range(5, 13),
              say=None) -> tuple[Form, dict]:
    """The combined form q(y, b) (b = 1 on the left branch) and what was chosen: {y1, y_zero, Y_R, m, d, errors};
    ``say(line)`` reports each split's degrees as they are found."""
    say = say or (lambda line: None)
    fT = ia.f_T
    # where the left branch is ≈ 0 and the right branch ≈ 1 to FLAT
    ytail = -np.geomspace(1e-300, -fT * 0.999, 6000)
    g_tail = ia.g(ytail, "left")
    y_zero = float(ytail[np.argmax(np.abs(g_tail) > _FLAT) - 1]) if np.abs(g_tail[0]) <= _FLAT else -1e-300
    yr = np.linspace(fT, fT + 80.0, 80001)[1:]
    far = np.abs(ia.g(yr, "right") - 1.0) > _FLAT
    Y_R = float(yr[np.nonzero(far)[0].max() + 1])

    def center_grid(p: float):
        y1 = fT * (1 - p)
        s1, sR = np.sqrt(y1 - fT), np.sqrt(Y_R - fT)
        sig = np.concatenate([-np.linspace(s1, 0, 4000, endpoint=False), np.linspace(0, sR, 6000)])
        return y1, s1, sR, (2 * sig - (sR - s1)) / (sR + s1), _g(ia, sig)

    _cheap_bound(ia, center_grid, min(splits), max(degrees))
    best = None
    for p in splits:
        y1, s1, sR, z, gc = center_grid(p)
        center = _first(lambda m, z=z, gc=gc: rational(z, gc, m), degrees)
        w0, w1, tail = _left_tail(ia, y_zero, y1, degrees)
        say(f"split {p}: rational degree {center[0] if center else '> ' + str(max(degrees))}, tail polynomial "
            f"degree {tail[0] if tail else '> ' + str(max(degrees))}")
        if center is None or tail is None:
            continue
        cost = 2 * center[0] + tail[0]
        if best is None or cost < best[0]:
            best = (cost, p, y1, s1, sR, w0, w1, center, tail)
    if best is None:
        raise NoFastForm(f"no fast form reaches {_FIT_TOL:g} for {ia.activation.name!r} with degrees ≤ "
                         f"{max(degrees)}", ia.activation)
    _, p, y1, s1, sR, w0, w1, (m, _, P, Q), (d, _, Tc) = best
    pm, qm, tm = C.cheb2poly(P), C.cheb2poly(Q), C.cheb2poly(Tc)
    pm, qm = pm / qm[0], qm / qm[0]  # monomial basis with Q(0) = 1 (Q > 0 on [−1, 1])
    coeffs = {**{f"p{i}": float(v) for i, v in enumerate(pm)}, **{f"q{i}": float(v) for i, v in enumerate(qm) if i},
              **{f"t{i}": float(v) for i, v in enumerate(tm)}}
    F = lambda v: sp.Float(float(v), 17)  # noqa: E731
    S = {k: sp.Symbol(k) for k in ("s", "z", "R", "w", "u")}
    A, B0 = 2 / (sR + s1), -(sR - s1) / (sR + s1)  # z = A·σ + B0 with σ = (1 − 2b)·s
    assignments = (
        ("s", sp.sqrt(sp.Max(y - F(fT), 0))),
        ("z", (F(A) - F(2 * A) * b) * S["s"] + F(B0)),
        ("R", _horner(S["z"], [sp.Symbol(f"p{i}") for i in range(m + 1)])
         / _horner(S["z"], [sp.Integer(1), *[sp.Symbol(f"q{i}") for i in range(1, m + 1)]])),
        ("w", sp.Max(sp.log(sp.Max(-y, F(1e-38))), F(w0))),  # beyond y₀ hold T(u) at its end: y·T stays tiny
        ("u", F(2 / (w0 - w1)) * S["w"] - F((w0 + w1) / (w0 - w1))),
    )
    # b·(y − y₁) > 0 only on the left branch's tail; y > Y_R only on the right branch (y ≤ 0 on the left)
    expression = select(y - F(Y_R), sp.Integer(1),
                        select(b * (y - F(y1)), y * _horner(S["u"], [sp.Symbol(f"t{i}") for i in range(d + 1)]),
                               S["R"]))
    info = {"split": p, "y1": y1, "y_zero": y_zero, "Y_R": Y_R, "rational_degree": m, "tail_degree": d}
    return Form(expression, coeffs, assignments), info


def branch(form: Form, side: str) -> Form:
    """The combined form with b fixed (1: left, 0: right), for the per-branch machinery (metrics, twin, atlas)."""
    v = sp.Integer(1 if side == "left" else 0)
    return Form(form.expression.subs(b, v), dict(form.coefficients),
                tuple((n, e.subs(b, v)) for n, e in form.assignments))


def fused_operations(form: Form) -> tuple[int, int]:
    """(transcendental, other) operations per element of the combined form, as a GPU runs it: √ and log are
    transcendental; a multiply feeding an add is one fused multiply-add; each select, max, compare-with-0 and
    division is one. Counted once per assignment, after common-subexpression elimination."""
    values = {sp.Symbol(k): sp.Float(v, 17) for k, v in form.coefficients.items()}
    trans = other = 0
    for e in [v for _, v in form.assignments] + [form.expression]:
        subs, (reduced,) = sp.cse(e.xreplace(values))
        for part in [x for _, x in subs] + [reduced]:
            t, o = _count(part)
            trans, other = trans + t, other + o
    return trans, other


def _count(e: sp.Expr) -> tuple[int, int]:
    if e.is_Atom:
        return 0, 0
    t = o = 0
    for a in e.args:
        ta, oa = _count(a)
        t, o = t + ta, o + oa
    if isinstance(e, sp.Pow) and e.exp == sp.Rational(1, 2) or isinstance(e, sp.log | sp.exp):
        return t + 1, o
    if isinstance(e, sp.Pow) and e.exp == -1:
        return t, o + 1  # a division
    if isinstance(e, sp.Add):
        fused = sum(1 for a in e.args if isinstance(a, sp.Mul) and len(a.args) == 2)  # counted inside already
        return t, o + (len(e.args) - 1) - min(fused, len(e.args) - 1)
    if isinstance(e, sp.Mul):
        return t, o + len(e.args) - 1
    if isinstance(e, select):
        return t, o + 1  # the select; its condition's subtraction is the compare
    if isinstance(e, sp.Max | sp.Min):
        return t, o + len(e.args) - 1
    return t, o + 1
