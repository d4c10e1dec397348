"""fitting/symbolic.py's constant refit: least squares with sympy's derivative as its Jacobian."""

import numpy as np
import sympy as sp
from approxbp.fitting.symbolic import _refit_constants


def test_the_refit_recovers_an_expressions_constants_from_a_rough_start():
    s_var = sp.Symbol("s")
    s = np.linspace(0, 1, 400)
    g = 0.3 + 2.0 * np.exp(-1.5 * s) - 0.25 * np.sqrt(s)
    rough = sp.Float(0.1) + sp.Float(1.0) * sp.exp(sp.Float(-1.0) * s_var) + sp.Float(-0.5) * sp.sqrt(s_var)
    template, coeffs = _refit_constants(rough, s_var, s, g)
    fitted = sp.lambdify(s_var, template.subs(coeffs))(s)
    assert np.max(np.abs(fitted - g)) < 1e-12, coeffs
    assert sorted(round(v, 9) for v in coeffs.values()) == [-1.5, -0.25, 0.3, 2.0]


def test_a_value_that_is_not_finite_on_part_of_the_samples_does_not_stop_the_refit():
    """log(0.8·s − 0.2) is NaN for s < 0.25: those residuals are clamped, their Jacobian rows are 0, and the refit
    still reaches the constants of the data, log(s − 0.2) (NaN for s ≤ 0.2)."""
    s_var = sp.Symbol("s")
    s = np.linspace(0, 1, 400)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = np.where(s > 0.2, np.log(s - 0.2), 0.0)
    _, coeffs = _refit_constants(sp.log(sp.Float(0.8) * s_var + sp.Float(-0.2)), s_var, s, g)
    assert abs(coeffs["c0"] + 0.2) < 1e-6 and abs(coeffs["c1"] - 1.0) < 1e-6, coeffs
