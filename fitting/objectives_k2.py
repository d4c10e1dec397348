"""The k = 2 ReLU-sum objectives with the levels projected out in closed form (Approx-BP eq. 63:
:class:`DerivativeObjectiveK2`; eq. 14: :class:`PrimitiveObjectiveK2`), as functions of three knot coordinates,
with what the branch and bound (:func:`.optimality.certify_relu_sum_global`) needs of them: values and gradients on
balls, lower bounds on boxes (monotone terms, the mean-value and second-order forms) and Hessians for convexity."""

from __future__ import annotations

import math

import numpy as np
import sympy as sp
from approxbp.approximations import balls, get_activation
from approxbp.approximations.activations import x as X_SYMBOL
from approxbp.approximations.rewrites import stable_form
from approxbp.approximations.tables import as_table
from flint import arb

from . import intervals as iv
from .intervals import Ball, Evaluator, box, complex_function

__all__ = ["DerivativeObjectiveK2", "Knots", "PrimitiveObjectiveK2", "ProjectedK2", "Steps"]


#: Boxes narrower than this (half-width) also get the second-order Taylor bound (it needs ∇²J and ∇³J).
_TAYLOR_WIDTH = 0.02
#: Cells of the grid of rigorous ∫h′² values (the monotone lower bound loses at most two cells' mass per term).
_GRID_CELLS = 2048
#: The Hessian's upper triangle (i ≤ j), in the order its entries and their ∇ are built and read.
_PAIRS = tuple((i, j) for i in range(3) for j in range(i, 3))


def _cells(grid: list, a: arb, b: arb) -> tuple[int, int] | None:
    """Indices i < j of a uniform grid with [g_i, g_j] ⊆ [a, b], or None."""
    cells = len(grid) - 1
    scale = cells / float((grid[-1] - grid[0]).mid())
    i = max(0, math.ceil(float((a - grid[0]).upper()) * scale))
    j = min(cells, math.floor(float((b - grid[0]).lower()) * scale))
    while i <= cells and grid[i] < a:
        i += 1
    while j >= 0 and grid[j] > b:
        j -= 1
    return (i, j) if i < j else None


class Steps:
    """The B&B's coordinates (c₁, d₁, d₂) with c₂ = c₁ + d₁, c₃ = c₂ + d₂: knots ordered by construction."""

    names = "c1 d1 d2"

    @staticmethod
    def knot_ranges(lo: list, hi: list) -> tuple:
        """(c₁lo, c₁hi, c₂lo, c₂hi, c₃lo, c₃hi) of a box."""
        c2lo, c2hi = lo[0] + lo[1], hi[0] + hi[1]
        return lo[0], hi[0], c2lo, c2hi, c2lo + lo[2], c2hi + hi[2]

    @staticmethod
    def of(knots) -> list[float]:
        c1, c2, c3 = knots
        return [c1, c2 - c1, c3 - c2]

    @staticmethod
    def start_box(A: arb, B: arb) -> tuple[list, list]:
        return [A, arb(0), arb(0)], [B, B - A, B - A]

    @staticmethod
    def separated(X: list) -> bool:
        """Whether every point of the box has c₁ < c₂ < c₃ (where the closed form is defined)."""
        return X[1].lower() > 0 and X[2].lower() > 0


class Knots:
    """The B&B's coordinates (c₁, c₂, c₃) themselves: boxes that cannot be ordered are dropped, and a stiff c₂ is an
    axis the split can follow."""

    names = "c1 c2 c3"

    @staticmethod
    def knot_ranges(lo: list, hi: list) -> tuple:
        return lo[0], hi[0], lo[1], hi[1], lo[2], hi[2]

    @staticmethod
    def of(knots) -> list[float]:
        return list(knots)

    @staticmethod
    def start_box(A: arb, B: arb) -> tuple[list, list]:
        return [A, A, A], [B, B, B]

    @staticmethod
    def separated(X: list) -> bool:
        return X[0].upper() < X[1].lower() and X[1].upper() < X[2].lower()


class ProjectedK2:
    """What both k = 2 objectives share: J(c₁, d₁, d₂) after projecting out the levels, ``closed_form`` (sympy, for
    ∇²J and ∇³J), ``value_gradient`` on balls, ``monotone_lower`` on boxes; from these the box lower bounds."""

    ev: Evaluator
    cutoff = math.inf  # the B&B's prune level: the Taylor bound is computed only below it
    #: the B&B's coordinates (:class:`Steps` or :class:`Knots`)
    coordinates: type[Steps] | type[Knots] = Steps
    #: per coordinate, how much a unit of width costs the bound (√H_ii at the optimum): the B&B splits the side
    #: with the largest scaled width
    split_scale = (1.0, 1.0, 1.0)
    #: half-widths tried for the convexity box around the table's knots, largest first, and the sub-box size
    #: its Hessians start from (None: the whole box, bisected where needed)
    convex_radii: tuple[float, ...] = (0.1, 0.05, 0.02, 0.01, 3e-3, 1e-3, 3e-4, 1e-4)
    convex_piece: float | None = 5e-3
    #: boxes narrower than this (half-width) also get the second-order Taylor bound (it needs ∇²J and ∇³J)
    taylor_width = _TAYLOR_WIDTH
    #: whether boxes also get the direct enclosure of J and the mean-value form (useless where J's closed form
    #: cancels large terms: then only the monotone and Taylor bounds)
    direct_bounds = True

    def closed_form(self, c1, d1, d2) -> sp.Expr:
        raise NotImplementedError

    def value_gradient(self, c1, d1, d2) -> tuple[arb, list[arb] | None]:
        raise NotImplementedError

    def monotone_lower(self, lo: list, hi: list) -> float:
        raise NotImplementedError

    def variables(self) -> tuple[sp.Symbol, ...]:
        if not hasattr(self, "_vars"):
            self._vars = sp.symbols(self.coordinates.names, real=True)
        return self._vars

    def knot_ranges(self, lo: list, hi: list) -> tuple:
        """(c₁lo, c₁hi, c₂lo, c₂hi, c₃lo, c₃hi) of a box."""
        return self.coordinates.knot_ranges(lo, hi)

    def feasible(self, lo: list, hi: list) -> bool:
        """Whether the box may hold ordered knots c₁ ≤ c₂ ≤ c₃ ≤ B."""
        c1lo, c1hi, c2lo, c2hi, c3lo, c3hi = self.knot_ranges(lo, hi)
        return c3lo <= self.B and c1lo <= c2hi and c2lo <= c3hi

    def separated(self, X: list) -> bool:
        """Whether every point of the box has c₁ < c₂ < c₃ (where the closed form is defined)."""
        return self.coordinates.separated(X)

    def hessian(self, X: list) -> list[list[arb]]:
        """∇²J on a box with d₁, d₂ > 0, from the closed form (sympy derivatives evaluated on balls), in the
        mean-value form ∇²J(m) + ∇³J(X)·(X − m): the plain enclosure of the second derivatives is ±1 on a box of
        width 0.02 (their terms cancel), the centred one stays tight."""
        if not hasattr(self, "_hess"):  # the upper triangle only (sympy's derivatives are most of a first call)
            v = self.variables()
            expr = self.closed_form(*v)
            self._hess = tuple(sp.diff(expr, v[i], v[j]) for i, j in _PAIRS)
            self._third = tuple(sp.diff(h, v[k]) for h in self._hess for k in range(3))
        mid = [x.mid() for x in X]
        at = {**self._env(), **{s: Ball(m) for s, m in zip(self._vars, mid)}}
        over = {**self._env(), **{s: Ball(x) for s, x in zip(self._vars, X)}}
        second = self.ev.many(self._hess, at)
        third = self.ev.many(self._third, over)
        H = [[None] * 3 for _ in range(3)]
        for n, (i, j) in enumerate(_PAIRS):
            H[i][j] = H[j][i] = second[n].v + sum((third[3 * n + k].v * (X[k] - mid[k]) for k in range(3)), arb(0))
        return H

    def _env(self) -> dict:
        return {}

    def convex_lower(self, point: list, radius: float, piece: float = 5e-3, depth: int = 4) -> float | None:
        """If ∇²J is positive definite on the box of half-width ``radius`` around ``point`` (on sub-boxes of
        half-width ≤ ``piece``, each bisected up to ``depth`` times more where needed, every matrix of the
        enclosure: λ_min(midpoint) − ‖radius matrix‖₂ ≥ λ > 0), J is strongly convex there with modulus λ, and
        J ≥ J(p) − |∇J(p)|²/(2λ) on the whole box. Returns that bound, or None (at once where a midpoint matrix is
        not positive definite: J is not convex there)."""
        n = max(1, math.ceil(radius / piece))
        edges = [[arb(p) - radius + 2 * arb(radius) * k / n for k in range(n + 1)] for p in point]
        if not self.separated([box(e[0], e[-1]) for e in edges]):
            return None
        stack = [([box(edges[0][i], edges[0][i + 1]), box(edges[1][j], edges[1][j + 1]),
                   box(edges[2][k], edges[2][k + 1])], depth) for i in range(n) for j in range(n) for k in range(n)]
        lam = math.inf
        while stack:
            X, left = stack.pop()
            H = self.hessian(X)
            mid = np.array([[float(H[r][c].mid()) for c in range(3)] for r in range(3)])
            rad = np.array([[float(H[r][c].rad()) + abs(float(H[r][c].mid())) * 1e-15 for c in range(3)]
                            for r in range(3)])
            centre = float(np.linalg.eigvalsh((mid + mid.T) / 2)[0]) * (1 - 1e-9) - 1e-12
            here = centre - float(np.linalg.norm(rad, 2)) * (1 + 1e-9)
            if here > 0:
                lam = min(lam, here)
            elif centre > 0 and left > 0:
                halves = [(x.lower(), x.mid(), x.upper()) for x in X]
                stack += [([box(*halves[0][a:a + 2]), box(*halves[1][b:b + 2]), box(*halves[2][c:c + 2])], left - 1)
                          for a in (0, 1) for b in (0, 1) for c in (0, 1)]
            else:
                return None
        value, g = self.value_gradient(*(arb(p) for p in point))
        if g is None:
            return None
        bound = iv.proven_lower(value - sum((balls.square(gi) for gi in g), arb(0)) / (2 * lam))
        return bound if math.isfinite(bound) else None  # a NaN value proves nothing: no convex box

    def lower_bound(self, lo: list, hi: list) -> tuple[float, float]:
        """(a lower bound of J over the box of (c₁, d₁, d₂), an upper bound of J at the box centre). Each bound is
        finite or −∞ (:func:`~.intervals.kept`): a NaN from one form never hides another's finite bound, nor drops
        the box."""
        X = [box(a, b) for a, b in zip(lo, hi)]
        low = iv.kept(self.monotone_lower(lo, hi))
        g = None
        if self.direct_bounds:  # the direct enclosure and the mean-value form
            over, g = self.value_gradient(*X)
            low = max(low, iv.proven_lower(over))
        mid = [((a + b) / 2).mid() for a, b in zip(lo, hi)]
        at, g_mid = self.value_gradient(*mid)
        if not at.is_finite():
            return low, math.inf
        if g is not None:
            low = max(low, iv.proven_lower(at + sum((gi * (xi - mi) for gi, xi, mi in zip(g, X, mid)), arb(0))))
        ordered = g is not None or not self.direct_bounds and self.separated(X)
        if ordered and max(float(x.rad()) for x in X) < self.taylor_width and low < self.cutoff and g_mid is not None:
            low = max(low, iv.kept(self._taylor_lower(X, mid, at, g_mid)))
        c1, _, c2, _, c3, _ = self.knot_ranges(mid, mid)
        return low, float(at.upper()) if c1 < c2 < c3 <= self.B else math.inf  # J only at ordered knots in [A, B]

    def _taylor_lower(self, X, mid, at, g) -> float:
        """J(m) + ∇J(m)·Δ + ½ΔᵀH(X)Δ with Δ = X − m: the gradient at the centre is a point value, so the bound
        loses only O(|X|²·‖H‖) (the mean-value form loses the much wider ∇J(X)'s spread times |X|)."""
        H = self.hessian(X)
        delta = [x - m for x, m in zip(X, mid)]
        total = at + sum((gi * di for gi, di in zip(g, delta)), arb(0))
        quad = arb(0)
        for i in range(3):
            quad += H[i][i] * balls.square(delta[i])
            for j in range(i + 1, 3):
                quad += 2 * H[i][j] * delta[i] * delta[j]
        total += quad / 2
        return iv.proven_lower(total)


class DerivativeObjectiveK2(ProjectedK2):
    """J(c₁, c₂, c₃) of the derivative objective (eq. 63) for k = 2, in closed form after variable projection
    (levels L_j = Δh_j/d_j + μ with μ = (c₃ − h(c₃) + h(c₁))/(c₃ − c₁), which holds Σw·c = 0):

        J = ∫_A^B h′² − 2(h(B) − h(c₃)) + (B − c₃) + (c₃ − h(c₃) + h(c₁))²/(c₃ − c₁) − Σ_{j=1,2} Δh_j²/d_j,

    with Δh_j = h(c_{j+1}) − h(c_j), d_j = c_{j+1} − c_j. On boxes: Δh²/d = m²·d with the mean slope m ∈ h′(hull)
    where d may vanish; the gradient (envelope theorem) gives the mean-value form where the box is ordered."""

    def __init__(self, t):
        self.t = as_table(t)
        act = get_activation(self.t.expression)
        # log(1 + eˣ) as softplus (by its endpoints): log of the ball 1 + e^[0, 75] holds 0, and Mish's h was NaN
        self.h, self.dh = stable_form(act.expr), stable_form(act.derivative_expr(1))
        self.ev = Evaluator()
        self.A, self.B = (arb(v) for v in self.t.interval)
        from flint import acb

        sq = complex_function(self.dh**2, X_SYMBOL)
        sq1 = complex_function((self.dh - 1) ** 2, X_SYMBOL)
        self.K = acb.integral(sq, self.A, self.B, rel_tol=2.0**-90).real
        self.hB = self._h(self.B)
        # ∫h′² and ∫(h′ − 1)² from A to each grid point (rigorous, cumulative): monotone lower bounds of the terms
        self.grid = [self.A + (self.B - self.A) * i / _GRID_CELLS for i in range(_GRID_CELLS + 1)]
        self.P, self.Q = [arb(0)], [arb(0)]
        for a, b in zip(self.grid[:-1], self.grid[1:]):
            self.P.append(self.P[-1] + acb.integral(sq, a, b, rel_tol=2.0**-60).real)
            self.Q.append(self.Q[-1] + acb.integral(sq1, a, b, rel_tol=2.0**-60).real)

    def monotone_lower(self, lo: list, hi: list) -> float:
        """J = ∫_A^{c₁} h′² + V(c₁, c₂) + V(c₂, c₃) + μ²(c₃ − c₁) + ∫_{c₃}^B (h′ − 1)², each term ≥ 0, where
        V(a, b) = ∫_a^b h′² − Δh²/(b − a) is the best constant fit's error, which grows with [a, b]. On a box each
        term is bounded below by its value on the smallest segment the box allows (grid cells inside it)."""
        c1lo, c1hi, c2lo, c2hi, c3lo, c3hi = self.knot_ranges(lo, hi)
        terms = []
        cells = _cells(self.grid, self.A, c1lo)
        if cells:
            terms.append(self.P[cells[1]] - self.P[cells[0]])
        cells = _cells(self.grid, c3hi, self.B)
        if cells:
            terms.append(self.Q[cells[1]] - self.Q[cells[0]])
        for a, b in ((c1hi, c2lo), (c2hi, c3lo)):
            cells = _cells(self.grid, a, b) if a < b else None
            if cells:
                terms.append(self.P[cells[1]] - self.P[cells[0]] - (self._h(b) - self._h(a)) ** 2 / (b - a))
        d13 = box(lo[1] + lo[2], hi[1] + hi[2])
        num = self._u(box(c3lo, c3hi)) + self._h(box(c1lo, c1hi))
        if d13.upper() > 0:
            terms.append(balls.square(num) / d13.upper())
        return iv.nonnegative_sum(terms)

    def _h(self, c: arb) -> arb:
        return self.ev(self.h, {X_SYMBOL: Ball(c)}).v

    def _dh(self, c: arb) -> arb:
        return self.ev(self.dh, {X_SYMBOL: Ball(c)}).v

    def _u(self, c: arb) -> arb:
        """c − h(c), in the mean-value form around the centre of c."""
        m = c.mid()
        return iv.enclosure(Ball(m - self._h(m)), Ball(c - self._h(c), 1 - self._dh(c)), c, m)

    def _secant(self, ca, d, ha, hb):
        """(m, m²·d) for the segment [ca, ca + d]: m = Δh/d, enclosed by h′ on the hull where d may be 0."""
        m = self._dh(box(ca.lower(), (ca + d).upper()))
        if d.lower() > 0:
            m = m.intersection((hb - ha) / d) if m.overlaps((hb - ha) / d) else (hb - ha) / d
        return m, balls.square(m) * d

    def parts(self, c1, d1, d2):
        """(J − μ-term, μ-term, m₁₂, m₂₃, μ, c₃) at knots c₁, c₂ = c₁ + d₁, c₃ = c₂ + d₂ (balls; m: the secant
        slopes of h, μ None where d₁ + d₂ may vanish).
        The μ-term (c₃ − h(c₃) + h(c₁))²/(d₁ + d₂) is given by its lower bound (upper end lower + 1) where
        d₁ + d₂ may vanish, since only lower bounds are used there."""
        c2 = c1 + d1
        c3 = c2 + d2
        h1, h2, h3 = self._h(c1), self._h(c2), self._h(c3)
        m12, t12 = self._secant(c1, d1, h1, h2)
        m23, t23 = self._secant(c2, d2, h2, h3)
        u3 = self._u(c3)  # c₃ − h(c₃), centred: it cancels for large c₃
        d13, num = d1 + d2, u3 + h1
        if d13.lower() > 0:
            mu = num / d13
            mu_term = balls.square(num) / d13
        else:
            mu = None
            low = balls.square(num).lower() / d13.upper() if d13.upper() > 0 else arb(0)
            mu_term = box(low, low + 1)
        rest = self.K + self.B - 2 * self.hB + c3 - 2 * u3 - t12 - t23  # = K − 2(h(B) − h₃) + (B − c₃) − …
        return rest, mu_term, m12, m23, mu, c3

    def gradient(self, c1, d1, d2, parts=None):
        """∇J in (c₁, d₁, d₂) by the envelope theorem (``parts``: :meth:`parts` of the same point, if already
        computed); None where d₁ + d₂ may vanish (J → ∞ there)."""
        _, _, m12, m23, mu, c3 = parts or self.parts(c1, d1, d2)
        if mu is None:
            return None
        g1, g2, g3 = self._dh(c1), self._dh(c1 + d1), self._dh(c3)
        j1 = 2 * g1 * mu + mu * mu + 2 * m12 * g1 - m12 * m12
        j2 = -(2 * m12 * g2 - m12 * m12) + (2 * m23 * g2 - m23 * m23)
        j3 = 2 * g3 - 1 + 2 * (1 - g3) * mu - mu * mu - (2 * g3 * m23 - m23 * m23)
        return j1 + j2 + j3, j2 + j3, j3  # ∂/∂c₁ moves every knot, ∂/∂d₁ moves c₂ and c₃, ∂/∂d₂ moves c₃

    def value(self, c1, d1, d2) -> arb:
        rest, mu_term, *_ = self.parts(c1, d1, d2)
        return rest + mu_term

    def closed_form(self, c1, d1, d2) -> sp.Expr:
        """J up to constants (for its derivatives)."""
        h = lambda u: self.h.subs(X_SYMBOL, u)  # noqa: E731
        c2, c3 = c1 + d1, c1 + d1 + d2
        return c3 - 2 * (c3 - h(c3)) + (c3 - h(c3) + h(c1)) ** 2 / (d1 + d2) \
            - (h(c2) - h(c1)) ** 2 / d1 - (h(c3) - h(c2)) ** 2 / d2

    def value_gradient(self, c1, d1, d2):
        parts = self.parts(c1, d1, d2)
        return parts[0] + parts[1], self.gradient(c1, d1, d2, parts=parts)


def _antiderivative(name: str, integrand: sp.Expr):
    """A sympy function G with G′(z) = integrand(z) (for ∇J, ∇²J, ∇³J of closed forms built on it)."""
    def fdiff(self, argindex=1):
        return integrand.subs(X_SYMBOL, self.args[0])
    return type(name, (sp.Function,), {"nargs": 1, "fdiff": fdiff})


class PrimitiveObjectiveK2(ProjectedK2):
    """J(c₁, d₁, d₂) of the primitive objective (eq. 14) for k = 2. With Σw = 1 and Σw·c = 0, h̃ is 0 left of c₁,
    x right of c₃ and linear between, through (c₁, 0), (c₂, v), (c₃, c₃); J is quadratic in the one free value v:
    J = C − 2v·b + a·v², a = (d₁ + d₂)/3, b = M − d₂c₃/6, with M = ∫h·(hat at c₂). Projected (v = b/a):

        J = K + 2·G₁(c₃) − c₃³/3 − 2c₃·N + d₂c₃²/3 − 3(M − d₂c₃/6)²/(d₁ + d₂),
        M = (I₁ − c₁I₀)[c₁, c₂]/d₁ + (c₃I₀ − I₁)[c₂, c₃]/d₂,   N = (I₁ − c₂I₀)[c₂, c₃]/d₂,

    with I₀, I₁ the integrals of h and x·h over a segment, G₀, G₁, G₂ the antiderivatives of h, x·h, h² from A, and
    K = G₂(B) − 2G₁(B) + B³/3. G on a ball inside a grid cell is the cell's cumulative Arb integral plus a Taylor
    polynomial of Arb power-series coefficients with its remainder enclosed over the cell (:meth:`_G`)."""

    # In knots, ∇²J at the gelu optimum is stiff along c₂ only (diagonal 0.0043, 0.93, 0.0043; eigenvalues 0.0032,
    # 0.0037, 0.93): boxes follow c₂, and J is flat enough that provably convex boxes are small.
    coordinates = Knots
    convex_radii = (0.01, 3e-3, 1e-3, 3e-4, 1e-4)
    convex_piece = None
    taylor_width = 0.1
    direct_bounds = False  # K + 2G₁(c₃) − c₃³/3 − … cancels terms of size 10–100: a box of width 0.1 gives J ± 10

    def __init__(self, t, cells: int = _GRID_CELLS):
        from flint import acb

        self.t = as_table(t)
        h = stable_form(get_activation(self.t.expression).expr)  # softplus by its endpoints, as above
        self.A, self.B = (arb(v) for v in self.t.interval)
        tag = f"{id(self):x}"  # sympy compares functions by name: one set per instance
        integrands = {f"G0_{tag}": h, f"G1_{tag}": X_SYMBOL * h, f"G2_{tag}": h**2}
        self.G = {name: _antiderivative(name, e) for name, e in integrands.items()}
        self._complex = {name: complex_function(e, X_SYMBOL) for name, e in integrands.items()}
        self._real = integrands
        self.grid = [self.A + (self.B - self.A) * i / cells for i in range(cells + 1)]
        self.cum = {name: [arb(0)] for name in integrands}
        for a, b in zip(self.grid[:-1], self.grid[1:]):
            for name, f in self._complex.items():
                self.cum[name].append(self.cum[name][-1] + acb.integral(f, a, b, rel_tol=2.0**-100).real)
        self._cache: dict = {}
        self.ev = Evaluator(calls={name: self._moment(name) for name in integrands})
        self._plain = Evaluator()
        g0, g1, g2 = (self.cum[name][-1] for name in integrands)
        self.K = Ball(g2 - 2 * g1 + self.B**3 / 3)
        self._K = sp.Symbol("K")
        v = self.variables()
        self._J = self.closed_form(*v)
        self._grad = [sp.diff(self._J, s) for s in v]
        H = self.hessian([arb(c) for c in self.t.knots])  # at the table's knots
        self.split_scale = tuple(math.sqrt(abs(float(H[i][i].mid()))) + 1e-3 for i in range(3))

    def _env(self) -> dict:
        return {self._K: self.K}

    def closed_form(self, c1, c2, c3) -> sp.Expr:
        G0, G1, _ = self.G.values()
        d1, d2 = c2 - c1, c3 - c2
        i0 = lambda p, q: G0(q) - G0(p)  # noqa: E731
        i1 = lambda p, q: G1(q) - G1(p)  # noqa: E731
        M = (i1(c1, c2) - c1 * i0(c1, c2)) / d1 + (c3 * i0(c2, c3) - i1(c2, c3)) / d2
        N = (i1(c2, c3) - c2 * i0(c2, c3)) / d2
        return self._K + 2 * G1(c3) - c3**3 / 3 - 2 * c3 * N + d2 * c3**2 / 3 - 3 * (M - d2 * c3 / 6) ** 2 / (d1 + d2)

    def _cell(self, z: arb) -> int | None:
        """The grid cell i with g_i ≤ z ≤ g_{i+1} for the whole ball z, or None."""
        cells = len(self.grid) - 1
        i = math.floor(float(((z - self.A) / (self.B - self.A) * cells).mid()))
        for k in (i - 1, i, i + 1):
            if 0 <= k < cells and z.lower() >= self.grid[k] and z.upper() <= self.grid[k + 1]:
                return k
        return None

    def _taylor(self, name: str, i: int) -> tuple[list[arb], arb]:
        """Taylor coefficients a₀…a_{K−1} of the integrand at g_i (exact) and a_K over the cell (the remainder):
        φ(g_i + t) = Σ_{k<K} a_k t^k + a_K(ξ)·t^K, by Arb's power series (arb_series, K + 1 = its length)."""
        key = (name, i)
        if key not in self._cache:
            from flint import arb_series

            at = lambda x: self._plain(self._real[name], {X_SYMBOL: Ball(arb_series([x, 1]))}).v.coeffs()  # noqa: E731
            exact, cell = at(self.grid[i]), at(box(self.grid[i], self.grid[i + 1]))
            self._cache[key] = (exact[:-1], cell[len(exact) - 1])
        return self._cache[key]

    def _G(self, name: str, z: arb) -> arb:
        """G(z) = G(g_i) + Σ_k a_k·δ^{k+1}/(k + 1) + a_K(cell)·δ^{K+1}/(K + 1), δ = z − g_i ≥ 0, for a ball z inside
        cell i (tight for points and small balls); elsewhere the mean-value form around z's centre, whose value
        beyond the grid (c₃ > B in a box that straddles B) is Arb's integral from B."""
        i = self._cell(z)
        if i is not None:
            coefficients, remainder = self._taylor(name, i)
            delta = z - self.grid[i]
            total, power = arb(0), delta
            for k, a in enumerate(coefficients):
                total += a * power / (k + 1)
                power *= delta
            return self.cum[name][i] + total + remainder * power / (len(coefficients) + 1)
        m = z.mid()
        if z.rad() == 0:  # a point off the grid
            from flint import acb

            f = self._complex[name]
            return self.cum[name][-1] + acb.integral(f, self.B, m, rel_tol=2.0**-100).real
        slope = self._plain(self._real[name], {X_SYMBOL: Ball(z)}).v
        return self._G(name, m) + slope * (z - m)

    def _moment(self, name: str):
        def call(z: Ball) -> Ball:
            return Ball(self._G(name, z.v) if z.v.is_finite() else arb("nan"))
        return call

    def value_gradient(self, *point):
        env = {**self._env(), **{s: Ball(b) for s, b in zip(self.variables(), point)}}
        value, *grad = (b.v for b in self.ev.many((self._J, *self._grad), env))
        return value, grad if all(g.is_finite() for g in grad) else None

    def monotone_lower(self, lo: list, hi: list) -> float:
        """J ≥ ∫_A^{c₁} h² + E(c₁, c₂) + E(c₂, c₃) + ∫_{c₃}^B (h − x)², E(p, q) = the least-squares error of the
        best line on [p, q] (h̃ is a line there), which grows with [p, q]: each term at the smallest segment the
        box allows, rounded inward to grid points."""
        c1lo, c1hi, c2lo, c2hi, c3lo, c3hi = self.knot_ranges(lo, hi)
        G0, G1, G2 = (self.cum[name] for name in self.G)
        terms = []
        pieces = ((self.A, c1lo, "left"), (c1hi, c2lo, "line"), (c2hi, c3lo, "line"), (c3hi, self.B, "right"))
        for a, b, piece in pieces:
            cells = _cells(self.grid, a, b) if a < b else None
            if not cells:
                continue
            i, j = cells
            p, q = self.grid[i], self.grid[j]
            i0, i1, i2 = G0[j] - G0[i], G1[j] - G1[i], G2[j] - G2[i]
            if piece == "left":
                term = i2
            elif piece == "right":
                term = i2 - 2 * i1 + (q**3 - p**3) / 3
            else:  # orthogonal basis 1, x − m on [p, q]: ∫1 = 2r, ∫(x − m)² = 2r³/3
                m, r = (p + q) / 2, (q - p) / 2
                term = i2 - i0**2 / (2 * r) - (i1 - m * i0) ** 2 / (2 * r**3 / 3)
            terms.append(term)
        return iv.nonnegative_sum(terms)


