"""The ReLU-sum family (Approx-BP §4.2, eq. 13).

    h̃(x) = Σ_{i=1}^{n} w_i ReLU(x − c_i),   n = 2^k − 1,   Σ w_i = 1,   Σ w_i c_i = 0.

Its derivative is a step function with 2^k levels L_0 = 0, L_j = w_1 + … + w_j, L_n = Σw = 1, so the
backward pass needs one k-bit code per element: code(x) = #{i : c_i < x} (left-continuous, like
PyTorch's ReLU whose derivative at 0 is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["check_bits", "MAX_BITS", "ReLUSum"]


MAX_BITS = 8


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer):
        raise TypeError(f"bits must be an integer in 1..{MAX_BITS}, got {bits!r}")
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS} (2^k − 1 ReLUs, k-bit codes), got {bits}")
    return int(bits)


@dataclass(frozen=True)
class ReLUSum:
    """h̃ with weights w (n) and ascending knots c (n); n = 2^k − 1."""

    weights: np.ndarray
    knots: np.ndarray

    def __post_init__(self):
        w = np.asarray(self.weights, dtype=np.float64).copy()
        c = np.asarray(self.knots, dtype=np.float64).copy()
        if w.ndim != 1 or c.shape != w.shape:
            raise ValueError(f"weights and knots must be 1-D of equal length, got {w.shape} and {c.shape}")
        n = w.size
        if n < 1 or (n + 1) & n:
            raise ValueError(f"a ReLU sum has 2^k − 1 terms (1, 3, 7, …, 255), got {n}")
        check_bits(int(np.log2(n + 1)))
        if not (np.all(np.isfinite(w)) and np.all(np.isfinite(c))):
            raise ValueError("weights and knots must be finite (found NaN or ±inf)")
        if np.any(np.diff(c) < 0):
            raise ValueError(f"knots must be ascending, got {c.tolist()}")
        w.flags.writeable = c.flags.writeable = False
        object.__setattr__(self, "weights", w)
        object.__setattr__(self, "knots", c)

    @classmethod
    def from_levels(cls, knots, levels) -> ReLUSum:
        """Build from ascending knots and the 2^k derivative levels (w_i = L_i − L_{i−1})."""
        return cls(np.diff(np.asarray(levels, dtype=np.float64)), knots)

    @property
    def bits(self) -> int:
        return int(np.log2(self.weights.size + 1))

    @property
    def levels(self) -> np.ndarray:
        """The 2^k derivative values left to right: [0, w_1, w_1+w_2, …, Σw]."""
        return np.concatenate([[0.0], np.cumsum(self.weights)])

    @property
    def constraint_residual(self) -> float:
        """max(|Σw − 1|, |Σw·c|): zero for a valid member of eq. 13."""
        return float(max(abs(self.weights.sum() - 1.0), abs(np.dot(self.weights, self.knots))))

    def __call__(self, x):
        """h̃(x) = Σ w_i ReLU(x − c_i)."""
        x = np.asarray(x, dtype=np.float64)
        return np.maximum(x[..., None] - self.knots, 0.0) @ self.weights

    def codes(self, x) -> np.ndarray:
        """k-bit code per element: #{i : c_i < x} ∈ 0..2^k−1."""
        return np.searchsorted(self.knots, np.asarray(x, dtype=np.float64), side="left").astype(np.uint8)

    def derivative(self, x):
        """h̃'(x) = levels[code(x)]."""
        return self.levels[self.codes(x)]
