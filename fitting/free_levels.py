"""FewBit's family for comparison: k-bit quantised derivatives with free levels (Novikov et al., "Few-bit backward").

FewBit fits q(x), piecewise constant with 2^k free levels and n = 2^k − 1 borders, to h′ on [A, B] = [−100, 100]
with uniform weight. Unlike Approx-BP's eq. 13 there is no Σw = 1, Σw·c = 0 (the end levels are free too), so q is
not the derivative of a ReLU sum with h̃(x) → x. The best level on a segment is the mean of h′ there, the secant
slope mᵢ = (h(cᵢ₊₁) − h(cᵢ))/(cᵢ₊₁ − cᵢ) (c₀ = A, cₙ₊₁ = B), so

    J(c) = ∫_A^B h′² dx − Σᵢ (h(cᵢ₊₁) − h(cᵢ))² / (cᵢ₊₁ − cᵢ),   ∂J/∂cᵢ = (h′(cᵢ) − mᵢ₋₁)² − (h′(cᵢ) − mᵢ)²,

a sum over segments: the grid DP (:mod:`.grid_dp`) finds its optimum on a knot grid exactly, and the polish
(L-BFGS-B and Newton, as for eq. 13) finishes it. ∫h′² comes from adaptive quadrature split at 0.

Weighted by the inputs' density p (``--weight``, :mod:`.weights`; the interval then the weight's own), the same
holds with P = ∫p, M = ∫h′p, E = ∫h′²p in place of x, h and ∫h′²: the best level on a segment is ΔM/ΔP, J(c) =
E − Σᵢ ΔMᵢ²/ΔPᵢ and ∂J/∂cᵢ = p(cᵢ)·((h′(cᵢ) − mᵢ₋₁)² − (h′(cᵢ) − mᵢ)²); P, M and E are prefix sums of 10-point
Gauss–Legendre panels split at h′'s kinks and p's jumps (:class:`_Moments`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from approxbp.approximations import Activation, get_activation
from approxbp.approximations.relu_sum import ReLUSum, check_bits
from scipy.integrate import quad

__all__ = ["FEWBIT_INTERVAL", "fewbit_reference", "fit_free_levels", "FreeLevelsFit", "FreeLevelsObjective",
           "PublishedQuantiser", "WeightedFreeLevels"]


#: FewBit's domain.
FEWBIT_INTERVAL = (-100.0, 100.0)


class FreeLevelsObjective:
    """J(c) above for one activation, bit-width and interval; call it for (J, ∇J)."""

    objective = "derivative"  # the grid's knot density (piecewise-constant fits of h′)

    def __init__(self, activation: str | Activation, bits: int, interval=FEWBIT_INTERVAL):
        self.activation = get_activation(activation)
        self.bits = check_bits(bits)
        self.n = 2**self.bits - 1
        self.A, self.B = map(float, interval)
        if not (np.isfinite(self.A) and np.isfinite(self.B) and self.A < self.B):
            raise ValueError(f"interval must be finite with A < B, got {interval!r}")
        df = self.activation.df
        inner = sorted({p for p in (0.0, *self.activation.kinks()) if self.A < p < self.B})  # kinks: h′ jumps
        self.energy = sum(quad(lambda x: float(df(x)) ** 2, lo, hi, limit=500, epsabs=0, epsrel=1e-13)[0]
                          for lo, hi in zip([self.A, *inner], [*inner, self.B]))
        self.nfev = 0

    def levels(self, c: np.ndarray) -> np.ndarray:
        """The 2^k optimal levels (segment means of h′) for sorted borders c."""
        b = np.concatenate([[self.A], np.sort(c), [self.B]])
        return np.diff(self.activation.f(b)) / np.diff(b)

    def __call__(self, c) -> tuple[float, np.ndarray]:
        self.nfev += 1
        c = np.asarray(c, dtype=np.float64)
        order = np.argsort(c, kind="stable")
        b = np.concatenate([[self.A], c[order], [self.B]])
        h = self.activation.f(b)
        d = np.diff(b)
        with np.errstate(divide="ignore", invalid="ignore"):
            m = np.where(d > 0, np.diff(h) / np.where(d > 0, d, 1.0), self.activation.df(b[:-1]))
        loss = self.energy - float(np.sum(np.where(d > 0, m * np.diff(h), 0.0)))
        t = self.activation.df(c[order])
        g = (t - m[:-1]) ** 2 - (t - m[1:]) ** 2
        grad = np.empty_like(g)
        grad[order] = g
        return max(loss, 0.0), grad

    def loss_of(self, borders, levels) -> float:
        """J of any step function (borders inside [A, B], one level per segment), e.g. a published table's,
        by quadrature of (h′ − q)² split at every border."""
        b = np.concatenate([[self.A], np.sort(np.asarray(borders, float)), [self.B]])
        if len(levels) != b.size - 1:
            raise ValueError(f"{b.size - 1} segments need as many levels, got {len(levels)}")
        df, kinks = self.activation.df, self.activation.kinks()

        def piece(lo: float, hi: float, q: float) -> float:
            # a border a few ulps from a kink leaves a piece quad cannot subdivide (it warns): there the midpoint
            # rule's error, width³·max|∂²|/24, is far below the loss's own float64 rounding
            if hi - lo <= 1e-9 * max(1.0, abs(lo), abs(hi)):
                return (hi - lo) * (float(df((lo + hi) / 2)) - q) ** 2
            return quad(lambda x: (float(df(x)) - q) ** 2, lo, hi, limit=500, epsabs=0, epsrel=1e-12)[0]

        total = 0.0
        for lo, hi, q in zip(b[:-1], b[1:], levels):
            cuts = [lo, *(k for k in kinks if lo < k < hi), hi]  # h′ is smooth between kinks
            total += sum(piece(a, z, q) for a, z in zip(cuts[:-1], cuts[1:]) if z > a)
        return total


class _Moments:
    """∫_A^x of p, h′p and h′²p at any x in [A, B]: prefix sums over panels (4096 across [A, B], split at h′'s kinks
    and p's jumps) plus 10-point Gauss–Legendre on the last partial panel."""

    _NODES, _WEIGHTS = np.polynomial.legendre.leggauss(10)

    def __init__(self, df, pdf, A: float, B: float, breaks):
        self.df, self.pdf = df, pdf
        inner = [b for b in breaks if A < b < B]
        self.edges = np.unique(np.concatenate([np.linspace(A, B, 4097), inner]))
        lo, hi = self.edges[:-1], self.edges[1:]
        cells = self._panel(lo, hi)
        self.prefix = np.concatenate([np.zeros((1, 3)), np.cumsum(cells, axis=0)])

    def _panel(self, lo, hi) -> np.ndarray:
        """[∫p, ∫h′p, ∫h′²p] over each [lo, hi] (rows)."""
        half, mid = (hi - lo)[:, None] / 2, (hi + lo)[:, None] / 2
        x, w = mid + half * self._NODES, half * self._WEIGHTS
        wp, d = w * self.pdf(x), self.df(x)
        return np.stack([wp.sum(1), (wp * d).sum(1), (wp * d * d).sum(1)], axis=1)

    def __call__(self, x) -> np.ndarray:
        """Rows [P, M, E] at each x (one row for a number)."""
        x = np.asarray(x, dtype=np.float64)
        flat = x.reshape(-1)
        j = np.clip(np.searchsorted(self.edges, flat, side="right") - 1, 0, self.edges.size - 2)
        out = self.prefix[j] + self._panel(self.edges[j], flat)
        return out[0] if x.ndim == 0 else out


class WeightedFreeLevels(FreeLevelsObjective):
    """J(c) = ∫(h′ − q)² p on the weight's interval (module docstring): FewBit's family fitted to what the model
    feeds the activation."""

    def __init__(self, activation: str | Activation, bits: int, weight, interval=None):
        self.weight = weight
        super().__init__(activation, bits, interval or weight.interval)
        self.moments = _Moments(self.activation.df, weight.pdf, self.A, self.B,
                                [*self.activation.kinks(), 0.0, *weight.jumps])
        self.energy = float(self.moments(self.B)[2])

    def _segments(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ΔP, ΔM) on the segments of the sorted borders c."""
        d = np.diff(self.moments(np.concatenate([[self.A], c, [self.B]])), axis=0)
        return d[:, 0], d[:, 1]

    def levels(self, c: np.ndarray) -> np.ndarray:
        c = np.sort(c)
        dP, dM = self._segments(c)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(dP > 0, dM / np.where(dP > 0, dP, 1.0), self.activation.df(np.concatenate([[self.A], c])))

    def __call__(self, c) -> tuple[float, np.ndarray]:
        self.nfev += 1
        c = np.asarray(c, dtype=np.float64)
        order = np.argsort(c, kind="stable")
        dP, dM = self._segments(c[order])
        with np.errstate(divide="ignore", invalid="ignore"):  # a segment of no width: its level is h′ there
            m = np.where(dP > 0, dM / np.where(dP > 0, dP, 1.0), self.activation.df(np.concatenate([[self.A],
                                                                                                c[order]])))
        loss = self.energy - float(np.sum(dM * m))
        t = self.activation.df(c[order])
        g = self.weight.pdf(c[order]) * ((t - m[:-1]) ** 2 - (t - m[1:]) ** 2)
        grad = np.empty_like(g)
        grad[order] = g
        return max(loss, 0.0), grad

    def loss_of(self, borders, levels) -> float:
        """∫(h′ − q)² p = E − 2 Σ q ΔM + Σ q² ΔP of any step function on the interval."""
        b = np.sort(np.asarray(borders, float))
        q = np.asarray(levels, dtype=np.float64)
        if q.size != b.size + 1:
            raise ValueError(f"{b.size + 1} segments need as many levels, got {q.size}")
        dP, dM = self._segments(b)
        return max(self.energy - float(np.sum(2 * q * dM - q * q * dP)), 0.0)

    def grid_density(self, x: np.ndarray) -> np.ndarray:
        """Where knots go for a weighted piecewise-constant L2 fit of h′: ∝ (p·h″²)^⅓ (the grid DP's and the
        starts' density)."""
        return (self.weight.pdf(x) * self.activation.d2f(x) ** 2) ** (1 / 3)


@dataclass
class FreeLevelsFit:
    activation: str
    bits: int
    interval: tuple[float, float]
    borders: np.ndarray
    levels: np.ndarray
    loss: float
    starts: dict[str, float]  # start label → its polished loss
    expression: str = ""  # the activation's expression (a user's named one is not in the registry)
    weight: object = None  # p (fitting/weights.py) the loss is weighted by, or None: uniform on the interval

    def recorded_loss(self) -> float:
        """J by quadrature split at every border (:meth:`FreeLevelsObjective.loss_of`): the fit's own value,
        energy − Σ m·Δh, cancels to ~1e-17 where J is 0 (hard-sigmoid's two borders at ±3), which a certificate's
        enclosure would then not hold. Weighted: ∫(h′ − q)² p from the same moments as the fit."""
        if self.weight is not None:
            obj = WeightedFreeLevels(self._activation(), self.bits, self.weight, self.interval)
        else:
            obj = FreeLevelsObjective(self._activation(), self.bits, self.interval)
        return obj.loss_of(self.borders, self.levels)

    def _activation(self) -> Activation:
        """The fitted activation under its own name (a user's named expression is not in the registry)."""
        act = get_activation(self.expression or self.activation)
        return Activation(self.activation, act.expr)

    def table(self, command: str | None = None):
        """The fit as a ReLU-sum table with ``levels_rule: free`` (h̃′ = ℓ₀ + Σ w_i [x > c_i], w the jumps between
        levels): the same kernels as eq. 13's tables (codes → levels), exported, patched and costed alike."""
        from approxbp.approximations.tables import ReluSumTable

        from .relu_sum import package_version

        steps = ReLUSum(np.diff(self.levels), self.borders)  # the jumps between levels, at the borders
        return ReluSumTable.new(
            self._activation(), steps, bits=self.bits, objective="derivative", interval=self.interval,
            loss=self.recorded_loss(), level0=float(self.levels[0]),
            metrics={"starts": self.starts, **({"weight": self.weight.describe()} if self.weight else {})},
            provenance={"method": "FewBit's free levels: grid DP and jittered starts, each polished",
                        "command": command or "", "package_version": package_version()})

    def save(self, path: str | Path, command: str | None = None) -> Path:
        """Write :meth:`table` to ``path`` atomically; returns the path."""
        from approxbp.approximations.tables import save

        return save(self.table(command), path)


def fit_free_levels(activation: str, bits: int, interval=None, restarts: int = 4, seed: int = 0,
                    weight=None) -> FreeLevelsFit:
    """The best free-level quantisation on ``interval`` (default FewBit's, or the ``weight``'s own): the grid-DP
    optimum and ``restarts`` jittered equidistributed starts, each polished; deterministic for a seed. With a
    ``weight`` (p, :mod:`.weights`) the loss is ∫(h′ − q)² p (:class:`WeightedFreeLevels`)."""
    from .grid_dp import free_levels_knots
    from .relu_sum import equidistributed_knots, polish

    if weight is not None:
        obj = WeightedFreeLevels(activation, bits, weight, interval)
    else:
        obj = FreeLevelsObjective(activation, bits, interval or FEWBIT_INTERVAL)
    rng = np.random.default_rng(seed)
    starts = {"grid DP": free_levels_knots(obj)}
    spread = _weighted_starts if weight is not None else equidistributed_knots
    starts.update({f"polish {i}": spread(obj, rng, 0.5) for i in range(restarts)})
    polished = {label: polish(obj, c) for label, c in starts.items()}
    losses = {label: obj(c)[0] for label, c in polished.items()}
    best = min(losses, key=losses.get)
    c = np.sort(polished[best])
    return FreeLevelsFit(obj.activation.name, bits, (obj.A, obj.B), c, obj.levels(c), losses[best], losses,
                         obj.activation.expression, weight)


def _weighted_starts(obj: WeightedFreeLevels, rng: np.random.Generator, jitter: float) -> np.ndarray:
    """Borders at jittered quantiles of :meth:`WeightedFreeLevels.grid_density` (a small uniform share keeps them
    apart where it vanishes)."""
    grid = np.linspace(obj.A, obj.B, 20001)
    dens = obj.grid_density(grid)
    dens = dens + 1e-3 * dens.mean() + 1e-300
    cdf = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2)])
    u = np.sort(np.clip((np.arange(obj.n) + 0.5 + rng.uniform(-jitter, jitter, obj.n)) / obj.n, 1e-6, 1 - 1e-6))
    return np.interp(u, cdf / cdf[-1], grid)


@dataclass(frozen=True)
class PublishedQuantiser:
    """One of FewBit's builtin tables: borders inside the domain, one level per segment, the objective value the
    reference file records for it, and the best optimum an independent search found."""

    activation: str
    bits: int
    interval: tuple[float, float]
    borders: np.ndarray
    levels: np.ndarray
    recorded: float
    best_found: float

    def loss(self) -> float:
        """Its objective measured here (adaptive quadrature split at every border)."""
        return FreeLevelsObjective(self.activation, self.bits, self.interval).loss_of(self.borders, self.levels)


def fewbit_reference(path: Path | None = None) -> dict[tuple[str, int], PublishedQuantiser]:
    """FewBit's builtin GELU/SiLU tables (1–4 bits) from the peer reference file (packaged:
    ``data/references/fewbit_builtin_gelu_silu.json``), by (activation, bits)."""
    if path is None:
        from importlib import resources

        path = Path(str(resources.files("approxbp.data"))) / "references" / "fewbit_builtin_gelu_silu.json"
    data = json.loads(Path(path).read_text())
    out = {}
    for key, borders in data["tables"].items():
        if not key.endswith("-borders"):
            continue
        act, bits = key[:4], int(key[4:6])
        b = np.asarray(borders, float)
        out[act, bits] = PublishedQuantiser(act, bits, (float(b[0]), float(b[-1])), b[1:-1],
                                            np.asarray(data["tables"][f"{key[:6]}-levels"], float),
                                            float(data["measured_objective_values"][act][str(bits)]),
                                            float(data["best_unconstrained_optimum_found"][act][str(bits)]))
    return out
