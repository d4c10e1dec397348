"""A global start for the ReLU-sum fits: the best knots on a grid, by dynamic programming.

Derivative objective (Approx-BP eq. 63). For knots c₁ < … < cₙ the optimal levels are the secant slopes
mᵢ = (h(cᵢ₊₁) − h(cᵢ))/(cᵢ₊₁ − cᵢ) shifted by μ = (cₙ − h(cₙ) + h(c₁))/(cₙ − c₁) (which holds Σw·c = 0), so

    J(c) = ∫_A^{c₁} h′² + ∫_{cₙ}^B (h′ − 1)² + Σᵢ [∫_{cᵢ}^{cᵢ₊₁} h′² − (h(cᵢ₊₁) − h(cᵢ))²/(cᵢ₊₁ − cᵢ)] + μ²(cₙ − c₁):

for fixed end knots the interior is a sum over segments, and the best n − 1 segments of [c₁, cₙ] for every pair of
ends are the (n − 1)-th min-plus power of the segment-cost matrix (repeated squaring). The minimum over the ends
is then the global optimum on the grid, up to its resolution.

Primitive objective (eq. 45). h̃ is continuous, which couples the segments; the DP minimises the relaxation in
which each interior segment gets its own least-squares line (a lower bound of J on the grid, with the same tails
∫_A^{c₁} h² and ∫_{cₙ}^B (h − x)²), and the polish restores continuity.

The grid has its points at quantiles of the asymptotically optimal knot density (as the equidistributed start),
so it is fine where knots crowd.
"""

from __future__ import annotations

import numpy as np

from .objective import ReluSumObjective

__all__ = ["free_levels_knots", "grid_dp_knots", "GRIDS"]


def _grid(obj: ReluSumObjective, points: int) -> np.ndarray:
    fine = np.linspace(obj.A, obj.B, 40001)
    p = 2 / 5 if obj.objective == "primitive" else 2 / 3
    dens = obj.grid_density(fine) if hasattr(obj, "grid_density") else np.abs(obj.activation.d2f(fine)) ** p
    if not dens.any():  # a piecewise-linear h (hard-sigmoid): h″ = 0 between kinks, a uniform grid
        dens[:] = 1.0
    dens += 0.05 * dens.mean()  # some points where h'' vanishes
    cdf = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2)])
    return np.interp(np.linspace(0.0, 1.0, points), cdf / cdf[-1], fine)


def _prefix(g: np.ndarray, values) -> np.ndarray:
    """∫_A^{g_j} v(x) dx for each grid point and each integrand v (8-point Gauss–Legendre per grid cell)."""
    t, w = np.polynomial.legendre.leggauss(8)
    lo, hi = g[:-1, None], g[1:, None]
    x = (lo + hi) / 2 + (hi - lo) / 2 * t
    wx = (hi - lo) / 2 * w
    out = []
    for v in values:
        cell = np.sum(wx * v(x), axis=1)
        out.append(np.concatenate([[0.0], np.cumsum(cell)]))
    return np.array(out)


def _segment_costs(obj: ReluSumObjective, g: np.ndarray) -> np.ndarray:
    """S[i, j]: the interior cost of one segment [g_i, g_j] (∞ for j ≤ i, and where it is not a number: such a
    segment is never chosen)."""
    f, df = obj.activation.f, obj.activation.df
    G = g.size
    with np.errstate(divide="ignore", invalid="ignore"):
        if hasattr(obj, "moments"):  # weighted free levels: ∫h′²p − (ΔM)²/ΔP, M = ∫h′p, P = ∫p
            P, M, E = obj.moments(g).T
            S = E[None, :] - E[:, None] - (M[None, :] - M[:, None]) ** 2 / (P[None, :] - P[:, None])
        elif obj.objective == "derivative":
            (F2,) = _prefix(g, [lambda x: df(x) ** 2])
            h = f(g)
            d = g[None, :] - g[:, None]
            S = F2[None, :] - F2[:, None] - (h[None, :] - h[:, None]) ** 2 / d
        else:  # least-squares line on each segment: residual of [1, x] regression of h
            m = _prefix(g, [lambda x: np.ones_like(x), lambda x: x, lambda x: x * x, f,
                                 lambda x: x * f(x), lambda x: f(x) ** 2])
            s1, sx, sxx, sf, sxf, sff = (row[None, :] - row[:, None] for row in m)
            det = s1 * sxx - sx * sx
            S = sff - (sxx * sf * sf - 2 * sx * sf * sxf + s1 * sxf * sxf) / det
    S = np.where(np.triu(np.ones((G, G), bool), 1) & ~np.isnan(S), np.maximum(S, 0.0), np.inf)
    return S


def _min_plus(a: np.ndarray, b: np.ndarray, chunk: int = 32) -> np.ndarray:
    """(a ⊗ b)[i, j] = min_k a[i, k] + b[k, j] for strictly upper-triangular a and b (∞ on and below the diagonal,
    as S and its powers are): rows r… of a chunk need only k, j > r, a third of the full product's work, and the
    minimum over the same finite terms is the same number."""
    G = a.shape[0]
    out = np.full_like(a, np.inf)
    for r in range(0, G - 1, chunk):
        out[r:r + chunk, r + 1:] = np.min(a[r:r + chunk, r + 1:, None] + b[None, r + 1:, r + 1:], axis=1)
    return out


def _power(S: np.ndarray, e: int) -> np.ndarray:
    result, base = None, S
    while e:
        if e & 1:
            result = base if result is None else _min_plus(result, base)
        e >>= 1
        if e:
            base = _min_plus(base, base)
    return result


def GRIDS(n: int) -> tuple[int, ...]:  # noqa: N802 (a table of sizes)
    """Grid sizes the fitter tries for n knots: the DP is exact on its grid, but which basin the polish then
    reaches depends on the grid (mish k = 5: 412 points miss the optimum 400 and 500 find), so k ≤ 5 tries three
    and k = 6 one of 800 points (≈ 4 s). From k = 7 on none: 800 points are ~6 per knot, too coarse to be global,
    the DP costs ≈ 20 s, and it never beat the restarts there (benchmarks/relu_sum_global.py)."""
    return (400, 500, 600) if n <= 31 else (800,) if n <= 63 else ()


def _points(n: int) -> int:
    return (GRIDS(n) or (800,))[0]


def _path(S: np.ndarray, start: int, end: int, segments: int) -> list[int]:
    """Grid indices start = i₀ < i₁ < … < i_segments = end minimising Σ S[iⱼ, iⱼ₊₁] (a DP with back-pointers)."""
    G = S.shape[0]
    best = np.full(G, np.inf)
    best[start] = 0.0
    back = []
    for _ in range(segments):
        cand = best[:, None] + S
        back.append(np.argmin(cand, axis=0))
        best = cand[back[-1], np.arange(G)]
    path = [end]
    for ptr in reversed(back):
        path.append(int(ptr[path[-1]]))
    return path[::-1]


def grid_dp_knots(obj: ReluSumObjective, points: int | None = None) -> np.ndarray:
    """The n knots on the grid minimising J (derivative objective) or its separable relaxation (primitive); for
    n = 1 eq. 13 leaves c = 0."""
    n = obj.n
    if n == 1:
        return np.zeros(1)
    G = points or _points(n)
    g = _grid(obj, G)
    f, df = obj.activation.f, obj.activation.df
    S = _segment_costs(obj, g)
    if obj.objective == "derivative":
        left, right = _prefix(g, [lambda x: df(x) ** 2, lambda x: (df(x) - 1) ** 2])
    else:
        left, right = _prefix(g, [lambda x: f(x) ** 2, lambda x: (f(x) - x) ** 2])
    total = _power(S, n - 1) + left[:, None] + (right[-1] - right)[None, :]
    if obj.objective == "derivative":
        h = f(g)
        with np.errstate(divide="ignore", invalid="ignore"):
            d = g[None, :] - g[:, None]
            mu = (g[None, :] - h[None, :] + h[:, None]) / d
            total = total + np.where(d > 0, mu * mu * d, np.inf)
    a, b = np.unravel_index(np.argmin(total), total.shape)
    return g[_path(S, int(a), int(b), n - 1)]  # the segments of the best end knots


def free_levels_knots(obj, points: int | None = None) -> np.ndarray:
    """FewBit's family (:mod:`.free_levels`): the n borders on the grid minimising Σ over the n + 1 segments of
    [A, B] of ∫h′² − (Δh)²/Δc, every level free: the best path of n + 1 segments from A to B, exactly."""
    G = points or _points(obj.n)
    g = _grid(obj, G)
    return g[_path(_segment_costs(obj, g), 0, G - 1, obj.n + 1)[1:-1]]
