"""Float32 approximations of elementary functions that the generated kernels use: the fits, not the Triton code
(kernels/codegen.py prints them; fitting/certify.py bounds their error rigorously)."""

from __future__ import annotations

import math

import numpy as np

#: log v = e·ln 2 + f·P(f) for v = 2^e·(1 + f), f ∈ [√½ − 1, √2 − 1): the kernels' ``_log_normal``.
LN2 = math.log(2)


def log1p_over_f(degree: int = 8) -> tuple[float, ...]:
    """Monomial coefficients (in f, constant first, rounded to float32) of a degree-``degree`` Chebyshev
    least-squares fit of log1p(f)/f on f ∈ [√½ − 1, √2 − 1] (20001 points): log1p(f) ≈ f·P(f)."""
    from numpy.polynomial import chebyshev as C
    from numpy.polynomial import polynomial as P

    lo, hi = np.sqrt(0.5) - 1, np.sqrt(2) - 1
    f = np.linspace(lo, hi, 20001)
    g = np.ones_like(f)
    g[f != 0] = np.log1p(f[f != 0]) / f[f != 0]
    in_t = C.cheb2poly(C.chebfit((2 * f - (lo + hi)) / (hi - lo), g, degree))  # monomials in t = a·f + b
    a, b = 2 / (hi - lo), -(lo + hi) / (hi - lo)
    in_f = np.zeros(degree + 1)
    for k, c in enumerate(in_t):
        term = P.polypow([b, a], k)
        in_f[:len(term)] += c * term
    return tuple(float(np.float32(c)) for c in in_f)
