"""The gradient error a table's backward makes, the number a user trades for memory (issue 35): for a ReLU-sum
table E_{x∼N(0,1)}[(h̃′(x) − f′(x))²]^½ (its levels between its knots against the exact derivative, on a grid of
[−10, 10] by the trapezoid rule; the N(0, 1) weight is below 1e-22 beyond), for an InvAct table its certified L∞
(the sampled one where no certificate is stored), 0 for the exact activation."""

from __future__ import annotations

import math

import numpy as np


def gradient_error(t) -> float:
    """See the module docstring; ``t`` a loaded relu-sum or invact table."""
    from .activations import get_activation

    if t.family == "invact":
        cert = t.metrics.get("certified") or {}
        return max(float((cert.get(b) or {}).get("bound", t.metrics[f"linf_{b}"])) for b in ("left", "right"))
    x = np.linspace(-10, 10, 400_001)
    approx = np.asarray(t.levels)[np.searchsorted(np.asarray(t.knots), x, side="left")]
    exact = get_activation(t.expression).df(x)
    w = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    return float(math.sqrt(np.sum(w * (approx - exact) ** 2) * (x[1] - x[0])))


def describe(t) -> str:
    """The error with its meaning, for reports."""
    what = "certified L∞ of f′(f⁻¹(y))" if t.family == "invact" else "E_N(0,1)[(h̃′ − f′)²]^½"
    return f"gradient error {gradient_error(t):.2g} ({what})"
