"""Float32 approximations of elementary functions that the generated kernels use: the fits and the hardware
primitives' stated errors, not the Triton code (kernels/codegen/ prints them; fitting/certify.py bounds their error
rigorously; tests check them exhaustively on 16-bit inputs)."""

from __future__ import annotations

import math
from functools import cache

import numpy as np

__all__ = ["LG2_ABS_ERROR", "LN2", "LOG2E", "phi_tail", "PHI_TAIL_P"]


LN2 = math.log(2)
LOG2E = 1 / LN2

#: The kernels' log is ``lg2.approx.ftz.f32`` times ln 2 (one MUFU.LG2; libdevice's logf is 26 SASS instructions).
#: PTX ISA: lg2.approx's absolute error is at most 2^-22.6 (taken as 2^-22 here); the product by ln 2 rounds once.
LG2_ABS_ERROR = 2.0**-22

#: Φ's tail for 16-bit data: Q(u) = Φ(−|u|) ≈ t·2^(P(t) − u²·log2(e)/2), t = 1/(1 + PHI_TAIL_P·|u|) (the shape of
#: Numerical Recipes' erfcc, refitted in base 2 for relative error); PHI_TAIL_P chosen by a scan (degree 8: 0.39).
PHI_TAIL_P = 0.39
_PHI_TAIL_DEGREE = 8
#: Φ(−|u|) underflows float32 beyond this |u|; the fit covers [0, PHI_TAIL_U].
_PHI_TAIL_U = 14.0


@cache
def phi_tail() -> tuple[float, ...]:
    """Monomial coefficients (constant first, rounded to float32) of P, the minimax fit (a linear programme on 8 000
    points of [0, PHI_TAIL_U]) of log2(Φ(−u)/t) + u²·log2(e)/2 in t = 1/(1 + PHI_TAIL_P·u). Its error in the exponent,
    times ln 2, is the relative error of Q: 1.1e-7 before float32 rounding."""
    from scipy.optimize import linprog
    from scipy.special import log_ndtr

    u = np.unique(np.concatenate([np.linspace(0, _PHI_TAIL_U, 6000), np.geomspace(1e-6, _PHI_TAIL_U, 2000)]))
    t = 1 / (1 + PHI_TAIL_P * u)
    target = log_ndtr(-u) / LN2 + u * u * LOG2E / 2 - np.log2(t)
    V = np.vander(t, _PHI_TAIL_DEGREE + 1, increasing=True)
    ones = np.ones((len(u), 1))
    m = _PHI_TAIL_DEGREE + 1  # min e subject to |V·a − target| ≤ e
    res = linprog(np.r_[np.zeros(m), 1.0], A_ub=np.block([[V, -ones], [-V, -ones]]), b_ub=np.r_[target, -target],
                  bounds=[(None, None)] * m + [(0, None)], method="highs")
    if not res.success:
        raise RuntimeError(f"Φ tail fit failed: {res.message}")
    return tuple(float(np.float32(c)) for c in res.x[:m])

