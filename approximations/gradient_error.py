"""The gradient error a table's backward makes, the number a user trades for memory: for a ReLU-sum
table E_{x∼N(0,1)}[(h̃′(x) − f′(x))²]^½ (its levels between its knots against the exact derivative, on a grid of
[−10, 10] by the trapezoid rule; the N(0, 1) weight is below 1e-22 beyond), for an InvAct table its certified L∞
(the sampled one where no certificate is stored), 0 for the exact activation. numpy only: the run-time side
(``patch_model``'s report) passes the derivative of the generated twin, the build side that of the expression."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["describe", "gradient_error", "GRID", "invact_error", "invact_table_error", "relu_sum_error",
           "relu_sum_table_error"]


GRID = np.linspace(-10, 10, 400_001)


def relu_sum_error(knots, levels, df: Callable[[np.ndarray], np.ndarray]) -> float:
    """E_{x∼N(0,1)}[(h̃′ − f′)²]^½ with h̃′ = levels[#{knots < x}] and f′ = ``df``."""
    approx = np.asarray(levels, dtype=np.float64)[np.searchsorted(np.asarray(knots, dtype=np.float64), GRID,
                                                                  side="left")]
    w = np.exp(-GRID * GRID / 2) / math.sqrt(2 * math.pi)
    return float(math.sqrt(np.sum(w * (approx - df(GRID)) ** 2) * (GRID[1] - GRID[0])))


def invact_error(metrics: dict) -> float:
    """The larger branch's certified L∞ (else its sampled L∞); a monotone table has the right branch only."""
    cert = metrics.get("certified") or {}
    return max(float((cert.get(b) or {}).get("bound", metrics[f"linf_{b}"]))
               for b in ("left", "right") if f"linf_{b}" in metrics)


def relu_sum_table_error(t) -> float:
    """:func:`relu_sum_error` of a loaded ReLU-sum table (build side: its expression's f′)."""
    from .activations import get_activation

    return relu_sum_error(t.knots, t.levels, get_activation(t.expression).df)


def invact_table_error(t) -> float:
    """:func:`invact_error` of a loaded InvAct table."""
    return invact_error(t.metrics)


def gradient_error(t) -> float:
    """See the module docstring; ``t`` a loaded table of any registered family (its record's hook)."""
    from .families import TABLE_FAMILIES, member

    return member(TABLE_FAMILIES, t.family, "gradient error").gradient_error(t)


def describe(family: str, value: float) -> str:
    """The error with its meaning (the family's record), for reports."""
    from . import tables  # noqa: F401 (importing it registers the built-in families)
    from .families import TABLE_FAMILIES, member

    return f"gradient error {value:.2g} ({member(TABLE_FAMILIES, family, 'gradient error').error_meaning})"
