"""Weights on the inputs of an activation, p(x) in the weighted ReLU-sum objectives ∫(h − h̃)² p and ∫(h′ − h̃′)² p
(``approxbp fit relu-sum --weight``): fits to what a model feeds the activation rather than to a uniform interval.

Each p is a density d(x) mixed with a share :data:`FLOOR` of the uniform density on the fit's interval [A, B]: the
floor keeps the levels bounded where d vanishes (eq. 13's constraint Σw·c = 0 would otherwise be met at no cost by
a level far out where no input goes). :class:`Normal` is N(0, σ²) on ±9σ; :class:`Histogram` a captured histogram
(``approxbp.capture.activation_inputs``), piecewise constant on its bins, the interval its span."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import mpmath
import numpy as np
from approxbp.approximations import get_activation

__all__ = ["FLOOR", "Histogram", "Normal", "Weight"]

#: The uniform share of every weight.
FLOOR = 1e-3
#: Gauss–Legendre nodes and weights on [−1, 1] for the gradient error (each panel between knots and jumps).
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(10)
#: A histogram file's size cap and its bin count's.
_MAX_BYTES, _MAX_BINS = 16 * 2**20, 100_000


class Weight:
    """What the objective reads of a weight: ``pdf`` (floored), ``density`` (d alone), ``interval``, ``jumps``
    (where d jumps: the quadrature splits there), ``describe()`` and the outside mass."""

    interval_rule = ""

    @staticmethod
    def parse(text: str) -> Weight:
        """``normal:σ`` (the inputs' standard deviation), or a histogram file written by
        ``approxbp.capture.activation_inputs`` (``.json``)."""
        text = str(text)
        if text.endswith(".json"):
            return Histogram.load(text)
        kind, _, value = text.partition(":")
        try:
            sigma = float(value)
        except ValueError:
            sigma = None
        if kind != "normal" or sigma is None:
            raise ValueError(f"--weight {text!r}: expected normal:σ (e.g. normal:2, the standard deviation of the "
                             "activation's inputs) or a histogram file (.json) of them")
        return Normal(sigma)

    def pdf(self, x) -> np.ndarray:
        A, B = self.interval
        x = np.asarray(x, dtype=np.float64)
        return (1 - FLOOR) * self.density(x) + np.where((x >= A) & (x <= B), FLOOR / (B - A), 0.0)

    def gradient_error(self, activation, knots, levels) -> float:
        """E_d[(h̃′ − h′)²]^½ of a ReLU sum (its knots, its levels [0, …, 1]) under the density d (no floor): the
        gradient error a backward feels on these inputs, by Gauss–Legendre split at the knots and the jumps."""
        act = get_activation(activation)
        A, B = self.interval
        c = np.asarray(knots, dtype=np.float64)
        edges = np.union1d(np.concatenate([[A, B], c]), self.jumps).clip(A, B)
        edges = np.unique(np.concatenate([edges, np.linspace(A, B, 129)]))  # panels no wider than (B − A)/128
        half, mid = np.diff(edges)[:, None] / 2, (edges[:-1] + edges[1:])[:, None] / 2
        x, w = (mid + half * _NODES).ravel(), (half * _WEIGHTS).ravel()
        level = np.asarray(levels, dtype=np.float64)[np.searchsorted(c, x, side="right")]
        return float(np.sqrt(np.dot(w * self.density(x), (level - act.df(x)) ** 2)))


@dataclass(frozen=True)
class Normal(Weight):
    """d = N(0, σ²) on ±:attr:`REACH`·σ (its mass beyond: 2Φ(−9) ≈ 2e-19, reported as the tail mass)."""

    sigma: float
    REACH = 9.0
    jumps = np.array([])

    def __post_init__(self):
        if not (isinstance(self.sigma, int | float) and math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"--weight normal:σ needs a finite σ > 0, got {self.sigma!r}")

    @property
    def interval(self) -> tuple[float, float]:
        return -self.REACH * self.sigma, self.REACH * self.sigma

    @property
    def interval_rule(self) -> str:
        return f"±{self.REACH:g}σ"

    def density(self, x) -> np.ndarray:
        z = np.asarray(x, dtype=np.float64) / self.sigma
        return np.exp(-0.5 * z * z) / (self.sigma * math.sqrt(2 * math.pi))

    def describe(self) -> str:
        return f"normal:{self.sigma:g}"

    def outside_mass(self, act, objective: str, a: float, b: float) -> float:
        """(1 − floor)·∫ d·t² outside [a, b] (t = h or h′ less its limit: 0 left, x or 1 right), 30-digit mpmath."""
        order = 0 if objective == "primitive" else 1
        sigma = mpmath.mpf(self.sigma)

        def normal(v):
            return mpmath.exp(-(v / sigma) ** 2 / 2) / (sigma * mpmath.sqrt(2 * mpmath.pi))
        with mpmath.workdps(30):
            left = mpmath.quad(lambda v: normal(v) * act.mp(v, order, None) ** 2, [-mpmath.inf, a])
            right = mpmath.quad(lambda v: normal(v) * (act.mp(v, order, None) - (v if order == 0 else 1)) ** 2,
                                [b, mpmath.inf])
        return float((1 - FLOOR) * (left + right))


@dataclass(frozen=True)
class Histogram(Weight):
    """d piecewise constant: ``counts`` over the bins between ``edges`` (count / (total · width)); the interval is
    the bins' span widened by half of it on each side (and to hold 0: A < 0 < B, as eq. 13's fits need), where
    only the floor weighs: inputs a little beyond the captured ones are still fitted."""

    edges: tuple[float, ...]
    counts: tuple[float, ...]
    source: str = ""
    interval_rule = "the histogram's span and half of it on each side"

    def __post_init__(self):
        e, c = np.asarray(self.edges, dtype=np.float64), np.asarray(self.counts, dtype=np.float64)
        if not (e.ndim == 1 and 2 <= e.size <= _MAX_BINS + 1 and c.shape == (e.size - 1,)):
            raise ValueError(f"histogram {self.source}: expected edges (2 … {_MAX_BINS + 1}) and one count per bin")
        if not (np.all(np.isfinite(e)) and np.all(np.diff(e) > 0) and np.all(np.isfinite(c)) and np.all(c >= 0)
                and c.sum() > 0):
            raise ValueError(f"histogram {self.source}: edges must be finite and increasing, counts finite, ≥ 0 "
                             "and not all 0")

    @classmethod
    def load(cls, path: str | Path) -> Histogram:
        p = Path(path)
        try:
            if p.stat().st_size > _MAX_BYTES:
                raise ValueError(f"{p}: over {_MAX_BYTES} bytes; a histogram file is smaller (refused unread)")
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"--weight {p}: not a readable histogram file ({type(err).__name__})") from None
        if not (isinstance(data, dict) and data.get("kind") == "histogram" and isinstance(data.get("edges"), list)
                and isinstance(data.get("counts"), list)):
            raise ValueError(f"--weight {p}: not a histogram file written by approxbp.capture (kind, edges, counts)")
        return cls(tuple(map(float, data["edges"])), tuple(map(float, data["counts"])), str(p))

    def save(self, path: str | Path) -> Path:
        Path(path).write_text(json.dumps({"kind": "histogram", "source": self.source, "edges": list(self.edges),
                                          "counts": list(self.counts)}))
        return Path(path)

    @property
    def interval(self) -> tuple[float, float]:
        lo, hi = self.edges[0], self.edges[-1]
        margin = (hi - lo) / 2  # inputs a little beyond the captured ones get the floor's weight, not none
        return min(lo - margin, -margin), max(hi + margin, margin)

    @functools.cached_property
    def jumps(self) -> np.ndarray:
        return np.asarray(self.edges, dtype=np.float64)

    @functools.cached_property
    def _heights(self) -> np.ndarray:
        """The density on each bin, 0 beyond them (computed once: the objective reads it at every evaluation)."""
        c = np.asarray(self.counts, dtype=np.float64)
        return np.concatenate([[0.0], c / (c.sum() * np.diff(self.jumps)), [0.0]])

    def density(self, x) -> np.ndarray:
        return self._heights[np.searchsorted(self.jumps, np.asarray(x, dtype=np.float64), side="right")]

    def describe(self) -> str:
        name = Path(self.source).name or "(in memory)"
        return f"histogram {name}, {len(self.counts)} bins, {sum(self.counts):g} inputs"

    def outside_mass(self, act, objective: str, a: float, b: float) -> float:
        return 0.0  # no input outside its span
