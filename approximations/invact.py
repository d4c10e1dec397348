"""Ground truth for inverted activations (Inverted Activations §2, eqs. 3–4).

For an activation f with exactly two monotone branches split at its minimiser T, the backward pass
needs g(y) = f'(f⁻¹(y)) on the left branch (x < T, s = 1) and the right branch (x ≥ T, s = 0).

* T and f(T) come from 60-digit mpmath; f(T) is kept as a double-double (hi + lo).
* Near the turning point, f(T + δ) − f(T) = Σ_{j≥2} a_j δ^j is solved for δ given t = y − f(T) (computed
  from the double-double, so t keeps full relative precision as y → f(T)); g = Σ j a_j δ^{j−1}. This is
  the explicit treatment of the square-root behaviour g ≈ ±√(2 f''(T) t).
* Elsewhere, a vectorised safeguarded Newton iteration (bisection fallback) on f(x) − y in float64,
  with brackets that reach the tails (y → lim_{x→−∞} f on the left, y → ∞ on the right).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mpmath
import numpy as np

from .activations import PIECEWISE, Activation, get_activation

__all__ = ["check_branch", "InvertedActivation"]


_BRANCHES = ("left", "right")
_TAYLOR_DEGREE = 24
_TAYLOR_RADIUS = 0.25


def check_branch(branch: str) -> str:
    if branch not in _BRANCHES:
        raise ValueError(f"branch must be 'left' (x < T) or 'right' (x ≥ T), got {branch!r}")
    return branch


@dataclass
class InvertedActivation:
    """f⁻¹ and g = f'∘f⁻¹ on both monotone branches of one activation, in float64."""

    activation: Activation
    T: float = field(init=False)
    f_T: float = field(init=False)

    def __post_init__(self):
        act = self.activation = get_activation(self.activation)
        grid = np.linspace(-60.0, 60.0, 24001)
        d = act.df(grid)
        sign = np.sign(d[np.abs(d) > 1e-300])
        changes = int(np.count_nonzero(sign[1:] != sign[:-1]))
        if changes != 1 or not (sign[0] < 0 < sign[-1]):
            raise ValueError(
                f"activation {act.name!r} does not have exactly two monotone branches (decreasing, then "
                f"increasing): f' changes sign {changes} time(s) on [-60, 60]; inverted activations need "
                "f = GELU/SiLU-like shapes with one minimiser T"
                + (f"; a piecewise activation flat left of 0 (relu2) takes the exact form: "
                   f"{act.fit_command('invact', '--form exact')}" if changes == 0 and act.name in PIECEWISE else
                   f"; an increasing one takes the exact one-branch form: {act.fit_command('invact', '--form exact')}"
                   " (it needs h′ > 0 in float64 on [−60, 60] and a closed-form inverse on each smooth piece)"
                   if changes == 0 else ""))
        i = int(np.argmax(d > 0))
        with mpmath.workdps(60):
            T = mpmath.findroot(lambda v: act.mp(v, 1, None), (mpmath.mpf(grid[i - 1]), mpmath.mpf(grid[i])),
                                solver="anderson")
            for _ in range(8):  # Newton polish: a_1 = f'(T) must vanish to ~1e-55 for the Taylor path
                T -= act.mp(T, 1, None) / act.mp(T, 2, None)
            fT = act.mp(T, 0, None)
            self.T_mp, self.f_T_mp = T, fT
            self.T, self.f_T = float(T), float(fT)
            self._f_T_lo = float(fT - mpmath.mpf(self.f_T))
            a = mpmath.taylor(lambda v: act.mp(v, 0, None), T, _TAYLOR_DEGREE)
            self._a = np.array([float(c) for c in a])
            self._a[:2] = 0.0  # f(T) is handled by t; f'(T) = 0
            self.left_limit = float(act.mp(-1000, 0, None))  # lim_{x→−∞} f(x): the left branch's open end
        self._t_switch = {b: float(np.polyval(self._a[::-1], s * _TAYLOR_RADIUS))
                          for b, s in (("left", -1.0), ("right", 1.0))}

    # ---- domains -----------------------------------------------------------------------------
    def domain(self, branch: str) -> tuple[float, float]:
        """The y-range of a branch: left [f(T), lim_{−∞} f), right [f(T), ∞)."""
        return (self.f_T, self.left_limit) if check_branch(branch) == "left" else (self.f_T, np.inf)

    def t_of(self, y) -> np.ndarray:
        """t = y − f(T) with f(T) as a double-double, so t keeps full relative precision near 0."""
        y = np.asarray(y, dtype=np.float64)
        return (y - self.f_T) - self._f_T_lo

    def _check(self, y: np.ndarray, branch: str) -> np.ndarray:
        check_branch(branch)
        if np.any(np.isnan(y)):
            raise ValueError("y contains NaN")
        t = self.t_of(y)
        tiny = 8 * np.finfo(float).eps * abs(self.f_T)
        lo, hi = self.domain(branch)
        bad = (t < -tiny) | ((y > hi) if branch == "left" else np.isinf(y))
        if np.any(bad):
            v = y[bad].ravel()[0]
            raise ValueError(f"y = {v!r} is outside the {branch} branch's range [{lo!r}, {hi!r}]"
                             f"{' (open at the right end)' if branch == 'left' else ''}")
        return np.maximum(t, 0.0)

    # ---- inverse and g ------------------------------------------------------------------------
    def inverse(self, y, branch: str) -> np.ndarray:
        """x = f⁻¹(y) on ``branch``."""
        return self._solve(y, branch)[0]

    def g(self, y, branch: str) -> np.ndarray:
        """g(y) = f'(f⁻¹(y)) on ``branch`` (the exact backward multiplier of eq. 3)."""
        return self._solve(y, branch)[1]

    def _solve(self, y, branch):
        y = np.asarray(y, dtype=np.float64)
        t = self._check(y, branch)
        sgn = -1.0 if branch == "left" else 1.0
        x = np.empty_like(y)
        g = np.empty_like(y)
        near = t <= self._t_switch[branch]
        if np.any(near):
            d, gd = self._taylor_solve(t[near], sgn)
            x[near], g[near] = self.T + d, gd
        far = ~near
        if np.any(far):
            x[far] = self._newton(y[far], branch)
            g[far] = self.activation.df(x[far])
        if branch == "left":
            at_end = y == self.left_limit
            x[at_end], g[at_end] = -np.inf, 0.0
        return x, g

    def _taylor_solve(self, t, sgn):
        a = self._a
        da = a[1:] * np.arange(1, a.size)
        d = sgn * np.sqrt(t / a[2])
        for _ in range(40):
            step = (np.polyval(a[::-1], d) - t) / np.where(d == 0, 1.0, np.polyval(da[::-1], d))
            d = d - step
            if np.all(np.abs(step) <= 2e-16 * np.abs(d)):
                break
        return d, np.polyval(da[::-1], d)

    def _newton(self, y, branch):
        f, df = self.activation.f, self.activation.df
        if branch == "left":
            hi = np.full_like(y, self.T - 0.5 * _TAYLOR_RADIUS)
            lo = np.full_like(y, -40.0)
            while np.any(f(lo) < y):
                lo = np.where(f(lo) < y, lo * 2, lo)
                if np.min(lo) < -1e6:
                    raise ValueError(f"no bracket for y near the left end {self.left_limit!r}")
        else:
            lo = np.full_like(y, self.T + 0.5 * _TAYLOR_RADIUS)
            hi = np.maximum(2 * np.abs(y) + 10.0, self.T + 1.0)
        x = (lo + hi) / 2 if branch == "left" else np.clip(y, lo, hi)
        moved = np.full_like(y, np.inf)
        for _ in range(200):
            F = f(x) - y
            # keep the bracket: f decreases on the left branch and increases on the right one
            above = F > 0
            if branch == "left":
                lo, hi = np.where(above, x, lo), np.where(above, hi, x)
            else:
                lo, hi = np.where(above, lo, x), np.where(above, x, hi)
            with np.errstate(divide="ignore", invalid="ignore"):  # f' = 0 or inf·0 in a tail: bisect instead
                step = F / df(x)
            xn = x - step
            out = (xn < lo) | (xn > hi) | ~np.isfinite(xn)
            xn = np.where(F == 0, x, np.where(out, (lo + hi) / 2, xn))  # an exact root stays put
            # converged: a step within 4e-16·|x|; or at rounding level, a step (≤ 64 of those) no smaller than the
            # last one: f(x) − y is rounding noise there and x hops between neighbouring floats
            tol, last, moved = 4e-16 * np.maximum(np.abs(x), 1e-300), moved, np.abs(xn - x)
            done = np.all((moved <= tol) | ((moved <= 64 * tol) & (moved >= last))) or np.all(F == 0)
            x = xn
            if done:
                break
        return x

    # ---- the 50-digit reference ---------------------------------------------------------------
    def g_mp(self, y: float, branch: str, dps: int = 50) -> mpmath.mpf:
        """g(y) by mpmath root finding at ``dps`` digits (the reference the float64 path is tested against)."""
        check_branch(branch)
        act = self.activation
        with mpmath.workdps(dps + 10):
            yv = mpmath.mpf(y)
            F = lambda v: act.mp(v, 0, None) - yv  # noqa: E731
            if branch == "left":  # f decreasing on (lo, T)
                lo, hi = mpmath.mpf(-40), self.T_mp
                while F(lo) < 0:
                    lo *= 2
                sign = -1
            else:
                lo, hi, sign = self.T_mp, mpmath.mpf(2 * abs(y) + 10), 1
            for _ in range(int(3.5 * (dps + 10)) + 20):  # bisection: robust at the double root y = f(T)
                mid = (lo + hi) / 2
                if sign * F(mid) > 0:
                    hi = mid
                else:
                    lo = mid
            x = (lo + hi) / 2
            return +act.mp(x, 1, None)
