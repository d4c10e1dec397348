"""Objectives for the ReLU-sum family on a finite interval [A, B] (Approx-BP eqs. 14/46/52 and 63).

    primitive:  E(w, c) = ∫_A^B (h − h̃)²  dx      (eq. 14, truncated as in eqs. 45/51)
    derivative: E(w, c) = ∫_A^B (h' − h̃')² dx     (eq. 63)

Variable projection: with Σw = 1 and Σw·c = 0, h̃ is the continuous piecewise-linear function with
breakpoints c that is 0 left of c_1 and equals x right of c_n. For fixed knots, the remaining values
(primitive) or levels (derivative) enter linearly and are solved exactly — a tridiagonal normal
system, or the closed form L_j = mean(h' on segment j) + μ. Only the knots are optimised; the
gradient dJ/dc follows from the envelope theorem. Integrals use composite Gauss–Legendre split at
every knot (the integrand is smooth between knots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mpmath
import numpy as np
from approxbp.approximations import Activation, ReLUSum, get_activation
from approxbp.approximations.relu_sum import check_bits
from approxbp.approximations.tails import Tail, mass_beyond, tail
from scipy.linalg import solveh_banded

from .weights import FLOOR, Weight

__all__ = ["check_objective", "interval_for", "OBJECTIVES", "quadrature", "ReluSumObjective"]


OBJECTIVES = ("primitive", "derivative")
_GL_POINTS = 10
_PANEL_WIDTH = 0.5
_XI, _WI = np.polynomial.legendre.leggauss(_GL_POINTS)


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    return objective


#: Graded panels (algebraic tails): beyond |x| = _PANEL_WIDTH/_GRADE a panel is _GRADE·|x| wide, not _PANEL_WIDTH.
_GRADE = 1 / 16


def _graded(x: np.ndarray, panel: float, inverse: bool = False) -> np.ndarray:
    """Φ(x) = ∫₀ˣ dt / max(panel, _GRADE·|t|), the panel count from 0 to x (or Φ⁻¹ with ``inverse``): uniform panels
    up to |x| = X₀ = panel/_GRADE, geometric beyond (ratio e^_GRADE), where an algebraic tail varies on the scale |x|
    and a 10-point Gauss–Legendre panel of that width is exact to rounding."""
    x0 = panel / _GRADE
    a, sign = np.abs(x), np.sign(x)
    if inverse:
        return sign * np.where(a <= x0 / panel, a * panel, x0 * np.exp(_GRADE * (a - x0 / panel)))
    return sign * np.where(a <= x0, a / panel, x0 / panel + np.log(np.maximum(a, x0) / x0) / _GRADE)


def quadrature(breaks: np.ndarray, panel: float = _PANEL_WIDTH, splits: np.ndarray | None = None,
               graded: bool = False):
    """Composite Gauss–Legendre nodes on [breaks[0], breaks[-1]], split at every break, and at every point of
    ``splits`` (a piecewise activation's kinks, where Gauss–Legendre would lose its order) without making it a
    segment of its own; ``graded``: panels widening geometrically beyond |x| = 8 (:func:`_graded`; the objective of
    an activation with an algebraic tail, whose interval reaches |x| = 64 … 256).

    Returns (x, weight, segment index, τ ∈ [0, 1] within the segment)."""
    if splits is not None and len(inside := splits[(splits > breaks[0]) & (splits < breaks[-1])]):
        edges = np.union1d(breaks, inside)
        x, w, sub, _ = quadrature(edges, panel, graded=graded)
        seg = (np.searchsorted(breaks, edges[:-1], side="right") - 1)[sub]  # the break segment holding each piece
        widths = np.diff(breaks)
        tau = ((x - breaks[seg]) / np.where(widths[seg] > 0, widths[seg], 1.0)).clip(0.0, 1.0)
        return x, w, seg, tau
    widths = np.diff(breaks)
    if graded:
        phi = _graded(breaks, panel)
        counts = np.maximum(1, np.ceil(np.diff(phi))).astype(np.int64)
    else:
        counts = np.maximum(1, np.ceil(widths / panel)).astype(np.int64)
    seg = np.repeat(np.arange(widths.size), counts)
    j = np.arange(seg.size) - np.repeat(np.cumsum(counts) - counts, counts)
    if graded:  # panel edges equally spaced in Φ, mapped back; a segment's ends are its breaks exactly
        step = np.diff(phi)[seg] / counts[seg]
        lo = np.where(j == 0, breaks[seg], _graded(phi[seg] + step * j, panel, inverse=True))
        hi = np.where(j == counts[seg] - 1, breaks[seg + 1], _graded(phi[seg] + step * (j + 1), panel, inverse=True))
        half = (hi - lo) / 2
    else:
        lo = breaks[seg] + widths[seg] * j / counts[seg]
        half = widths[seg] / counts[seg] / 2
    xq = (lo + half)[:, None] + half[:, None] * _XI
    wq = half[:, None] * _WI
    segq = np.repeat(seg, _GL_POINTS)
    safe = np.where(widths > 0, widths, 1.0)
    tau = ((xq.ravel() - breaks[segq]) / safe[segq]).clip(0.0, 1.0)
    return xq.ravel(), wq.ravel(), segq, tau


# ---- the interval and its tail bound ---------------------------------------------------------
def _tail_mass(act: Activation, objective: str, a: float, b: float) -> float:
    """∫_{−∞}^A t² + ∫_B^∞ (t − t_∞)², t = h (t_∞ = x) or h' (t_∞ = 1), in 30-digit mpmath."""
    order = 0 if objective == "primitive" else 1
    with mpmath.workdps(30):
        left = mpmath.quad(lambda v: act.mp(v, order, None) ** 2, [-mpmath.inf, a])
        right = mpmath.quad(lambda v: (act.mp(v, order, None) - (v if order == 0 else 1)) ** 2, [b, mpmath.inf])
    return float(left + right)


#: The interval search stops here: a tail whose mass beyond ±CAP is still over ε/2 is algebraic (or slower).
_CAP = 64.0


@lru_cache(maxsize=64)
def _interval(expression: str, name: str, objective: str, eps: float) -> tuple[float, float, float, str]:
    act = Activation.from_expression(name, expression)
    if name == "gelu":  # eq. 45: B = −A = sqrt(−2 ln ε)
        b, how = math.sqrt(-2 * math.log(eps)), "Approx-BP eq. 45: B = −A = sqrt(−2 ln ε)"
        return -b, b, _tail_mass(act, objective, -b, b), how
    if name == "silu":  # eq. 51: B = −A = −2 ln(ε/2)
        b, how = -2 * math.log(eps / 2), "Approx-BP eq. 51: B = −A = −2 ln(ε/2)"
        return -b, b, _tail_mass(act, objective, -b, b), how
    order = 0 if objective == "primitive" else 1
    left, right = _tails(act, order, name)

    heavy: list[str] = []

    def side(t: Tail) -> float:
        def mass(L):
            return mass_beyond(act, t, L)
        if (far := mass(_CAP)) > eps / 2:  # an algebraic tail: ±CAP, its outside mass a constant of the loss
            heavy.append(f"{t.describe().replace(' (', ', ').rstrip(')')}, {far:.3g} of it beyond |x| = {_CAP:g}")
            return _CAP
        lo, hi = 0.5, 1.0
        while mass(hi) > eps / 2:
            lo, hi = hi, hi * 2
        for _ in range(40):  # bisect until every point of (lo, hi] rounds up to the same thousandth
            if math.ceil(math.nextafter(lo, math.inf) * 1000) == math.ceil(hi * 1000):
                break
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mass(mid) > eps / 2 else (lo, mid)
        return math.ceil(hi * 1000) / 1000

    a, b = -side(left), side(right)
    how = f"numerical: each tail ≤ ε/2 = {eps / 2:g} (mpmath quad)"
    if heavy:
        how = (f"|x| ≤ {_CAP:g} where the tail is algebraic: {'; '.join(heavy)}. Beyond the outermost knot h̃ is "
               "exactly 0 or x, so the mass outside is a constant added to the loss whatever the knots, and a wider "
               "--interval changes only that constant; " + how.replace("numerical: ", "elsewhere "))
    return a, b, _outside(act, a, b, left, right), how


def _outside(act: Activation, a: float, b: float, left: Tail, right: Tail) -> float:
    """The residual's mass outside [a, b] (:func:`~approxbp.approximations.tails.mass_beyond` on each side)."""
    return mass_beyond(act, left, -a) + mass_beyond(act, right, b)


def _tails(act: Activation, order: int, name: str) -> tuple[Tail, Tail]:
    """The residual's (left, right) tails, each square-integrable, else the reason in one line."""
    tails = tuple(tail(act, order, side) for side in ("left", "right"))
    for t in tails:
        if not t.square_integrable:
            raise ValueError(f"activation {name!r}: {t.describe()}, so ∫ of its square beyond any interval is "
                             "infinite; the ReLU-sum objectives (Approx-BP eqs. 14, 63) need it finite")
    return tails


def interval_for(act: Activation, objective: str, interval: tuple[float, float] | None = None,
                 weight: Weight | None = None) -> tuple[float, float, float, str]:
    """[A, B], the tail mass outside it (mpmath), and how it was chosen.

    GELU and SiLU use the paper's closed forms with ε = 1e-8 (eqs. 45, 51; their true tails are far
    smaller). Other activations get the narrowest interval whose tails are each ≤ ε/2 with ε = 1e-16:
    a tail comparable to the achievable loss (≈1e-10 at k = 8) would let knots gather at the ends. A given
    ``interval`` (A < 0 < B) is used as it is, its outside mass reported; with a ``weight``, its ±REACH·σ."""
    check_objective(objective)
    if weight is not None:  # the weight's own interval (or the given one), its outside mass under p
        a, b = interval or weight.interval
        return a, b, weight.outside_mass(act, objective, a, b), (
            f"weighted by p = {weight.describe()} (with a {FLOOR:g} share uniform on the interval): "
            f"[{a:g}, {b:g}]" + (" given" if interval else f", {weight.interval_rule}"))
    if interval is not None:
        a, b = (float(v) for v in interval)
        if not (math.isfinite(a) and math.isfinite(b) and a < 0 < b):
            raise ValueError(f"--interval {a:g} {b:g}: expected finite A < 0 < B")
        left, right = _tails(act, 0 if objective == "primitive" else 1, act.name)
        mass = _outside(act, a, b, left, right)
        return a, b, mass, f"given: --interval {a:g} {b:g} (mass outside {mass:.3g}, not fitted)"
    eps = 1e-8 if act.name in ("gelu", "silu") else 1e-16
    return _interval(act.expression, act.name, objective, eps)


@lru_cache(maxsize=64)
def _algebraic(expression: str, order: int) -> bool:
    """Whether either tail of the residual (h or h′, order) falls algebraically: then the objective's panels are
    graded (:func:`quadrature`), every other activation keeps its uniform panels and its numbers."""
    act = Activation.from_expression("h", expression)
    return any(tail(act, order, side).kind == "algebraic" for side in ("left", "right"))


# ---- the objective ----------------------------------------------------------------------------
@dataclass
class ReluSumObjective:
    """J(c) = min over the linear parameters of E(w, c) for one activation, bit-width and objective."""

    activation: Activation
    bits: int
    objective: str
    interval: tuple[float, float]
    weight: Weight | None = None  # p(x): the objective weighted by it (None: uniform on the interval)

    def __post_init__(self):
        self.activation = get_activation(self.activation)
        self.bits = check_bits(self.bits)
        check_objective(self.objective)
        self.activation.check_relu_sum_asymptotics(self.bits)
        self.kinks = np.array(self.activation.kinks(), dtype=np.float64)  # where the quadrature splits its panels
        if self.weight is not None:  # and where the weight jumps (a histogram's bin edges)
            self.kinks = np.union1d(self.kinks, self.weight.jumps)
        self.graded = _algebraic(self.activation.expression, 0 if self.objective == "primitive" else 1)
        self.n = 2**self.bits - 1
        self.A, self.B = map(float, self.interval)
        self.target = self.activation.f if self.objective == "primitive" else self.activation.df
        self.nfev = 0  # evaluations of J so far (a restart reports its own count)

    # -- linear solve for fixed knots --------------------------------------------------------
    def _breaks(self, c: np.ndarray) -> np.ndarray:
        return np.concatenate([[self.A], c, [self.B]])

    def levels_for(self, c: np.ndarray, nodes=None) -> np.ndarray:
        """The optimal 2^k levels [0, L_1, …, L_{n−1}, 1] for sorted knots c (constraints exact)."""
        n, b = self.n, self._breaks(c)
        if n == 1:
            return np.array([0.0, 1.0])
        if self.objective == "derivative" and self.weight is None:
            h = self.activation.f(c)
            d = np.diff(c)
            mean = np.where(d > 0, np.diff(h) / np.where(d > 0, d, 1), self.activation.df(c[:-1]))
            return np.concatenate([[0.0], mean + self._shift(c, h), [1.0]])
        x, w, s, tau = nodes if nodes is not None else quadrature(b, splits=self.kinks, graded=self.graded)
        return self._levels(c, x, self._weigh(x, w), s, tau)[0]

    def _weigh(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Quadrature weights times p(x) (as they are without a weight)."""
        return w if self.weight is None else w * self.weight.pdf(x)

    def _levels(self, c: np.ndarray, x, w, s, tau) -> tuple[np.ndarray, float | None]:
        """(levels, the weighted derivative objective's μ or None) from nodes whose weights ``w`` hold p: the
        weighted closed form (derivative), else the primitive's tridiagonal normal system."""
        if self.objective == "derivative":
            return self._weighted_levels(c, x, w, s)
        n, b = self.n, self._breaks(c)
        V = np.zeros(n + 2)
        V[n], V[n + 1] = c[-1], self.B
        r0 = self.target(x) - (V[s] * (1 - tau) + V[s + 1] * tau)
        nb = n + 1
        A_ = np.bincount(s, w * (1 - tau) ** 2, nb)
        B_ = np.bincount(s, w * tau**2, nb)
        C_ = np.bincount(s, w * tau * (1 - tau), nb)
        R0 = np.bincount(s, w * (1 - tau) * r0, nb)
        R1 = np.bincount(s, w * tau * r0, nb)
        idx = np.arange(2, n)  # unknown values at c_2..c_{n−1}
        ab = np.zeros((2, idx.size))
        ab[1] = A_[idx] + B_[idx - 1]
        ab[0, 1:] = C_[idx[:-1]]
        rhs = R0[idx] + R1[idx - 1]
        try:
            V[idx] = rhs / ab[1] if idx.size == 1 else solveh_banded(ab, rhs)
        except np.linalg.LinAlgError:
            full = np.diag(ab[1]) + np.diag(ab[0, 1:], 1) + np.diag(ab[0, 1:], -1)
            V[idx] = np.linalg.lstsq(full, rhs, rcond=None)[0]
        d = np.diff(b)
        L = np.where(d > 0, np.diff(V) / np.where(d > 0, d, 1.0), 0.0)
        L[0], L[-1] = 0.0, 1.0
        return L, None

    def _weighted_levels(self, c: np.ndarray, x, w, s) -> tuple[np.ndarray, float]:
        """(levels, μ) of the weighted derivative objective for sorted knots c: on interior segment j (width d_j,
        P_j = ∫p, m_j = ∫p·h′ / P_j) L_j = m_j + μ·d_j/P_j, with μ = (c_n − Σ d_j m_j) / Σ d_j²/P_j holding
        Σw·c = 0 (p = 1 gives the uniform closed form: L_j = mean h′ + μ)."""
        n = self.n
        P = np.bincount(s, w, n + 1)[1:n]
        M = np.bincount(s, w * self.target(x), n + 1)[1:n]
        d = np.diff(c)
        held = P > 0
        safe = np.where(held, P, 1.0)
        m = np.where(held, M / safe, self.activation.df(c[:-1]))
        spread = float(np.sum(np.where(held, d * d / safe, 0.0)))
        mu = (c[-1] - float(np.dot(d, m))) / spread
        return np.concatenate([[0.0], m + mu * np.where(held, d / safe, 0.0), [1.0]]), mu

    @staticmethod
    def _shift(c: np.ndarray, h: np.ndarray) -> float:
        """μ = (c_n − h(c_n) + h(c_1))/(c_n − c_1): the level shift that holds Σw·c = 0 (derivative objective)."""
        return (c[-1] - h[-1] + h[0]) / (c[-1] - c[0])

    def solution(self, c) -> ReLUSum:
        """The optimal member of eq. 13 for knots c (sorted here)."""
        c = np.sort(np.asarray(c, dtype=np.float64))
        return ReLUSum.from_levels(c, self.levels_for(c))

    # -- value and gradient ------------------------------------------------------------------
    def __call__(self, c) -> tuple[float, np.ndarray]:
        """(J(c), dJ/dc) for knots in any order; the gradient is returned in the caller's order."""
        self.nfev += 1
        c = np.asarray(c, dtype=np.float64)
        if not np.all(np.isfinite(c)):
            raise ValueError(f"knots must be finite, got {c}")
        if c.shape != (self.n,) or np.any(c < self.A) or np.any(c > self.B):
            raise ValueError(f"expected {self.n} knots inside [{self.A}, {self.B}], got {c}")
        order = np.argsort(c, kind="stable")
        cs = c[order]
        if self.n > 1 and cs[-1] <= cs[0]:  # every knot at one point: eq. 13's Σw·c = 0 has no solution there
            return np.inf, np.zeros(self.n)  # a line search backs off, as from any infeasible step
        b = self._breaks(cs)
        nodes = quadrature(b, splits=self.kinks, graded=self.graded)
        x, w, s, tau = nodes
        w = self._weigh(x, w)
        unweighted_derivative = self.objective == "derivative" and self.weight is None
        L, mu = (self.levels_for(cs), None) if unweighted_derivative or self.n == 1 else self._levels(cs, x, w, s, tau)
        t = self.target(x)
        n = self.n
        if self.objective == "primitive":
            V = np.concatenate([[0.0], np.cumsum(L * np.diff(b))])  # h̃ at the breaks
            r = t - (V[s] * (1 - tau) + V[s + 1] * tau)
            loss = float(np.dot(w, r * r))
            P = np.bincount(s, w * r * (1 - tau), n + 1)
            Q = np.bincount(s, w * r * tau, n + 1)
            g = 2 * (L[1:] * P[1:] + L[:-1] * Q[:-1])
            g[-1] -= 2 * (P[n] + Q[n - 1])
        else:
            r = t - L[s]
            loss = float(np.dot(w, r * r))
            tc = self.activation.df(cs)
            g = (tc - L[:-1]) ** 2 - (tc - L[1:]) ** 2
            if self.weight is not None:
                g = self.weight.pdf(cs) * g
            if n > 1:
                mu = self._shift(cs, self.activation.f(cs)) if mu is None else mu
                inner = np.zeros(n + 1)
                inner[1:n] = L[1:n]
                g += 2 * mu * (inner[1:] - inner[:-1])
                g[-1] += 2 * mu
        grad = np.empty_like(g)
        grad[order] = g
        return loss, grad

    def loss(self, rs: ReLUSum) -> float:
        """E(w, c) for any ReLU sum (not only optimal ones), by quadrature split at its knots."""
        inside = rs.knots[(rs.knots > self.A) & (rs.knots < self.B)]
        x, w, s, _ = quadrature(np.concatenate([[self.A], inside, [self.B]]), splits=self.kinks, graded=self.graded)
        approx = rs(x) if self.objective == "primitive" else rs.derivative(x)
        # the derivative is a step function: evaluate it at node positions (never on a knot)
        return float(np.dot(self._weigh(x, w), (self.target(x) - approx) ** 2))
