"""Piecewise activations as smooth pieces (approximations.pieces, issue 47): the kinks where a switch changes branch,
the smooth expression between them, and unit steps whose arguments do not cancel."""

import numpy as np
import pytest
import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations.activations import x
from approxbp.approximations.pieces import kinks, pieces, sharpen


@pytest.mark.parametrize("name, want", [("elu", [0.0]), ("hardswish", [-3.0, 3.0]), ("relu2", [0.0]), ("gelu", [])])
def test_kinks(name, want):
    assert kinks(get_activation(name).expr) == want


def test_each_piece_is_the_activation_there():
    """Each smooth piece equals the activation on its interval (numpy, to rounding)."""
    act = get_activation("hardswish")
    parts = pieces(act.expr)
    assert [(lo, hi) for lo, hi, _ in parts] == [(-np.inf, -3.0), (-3.0, 3.0), (3.0, np.inf)]
    assert [str(f) for _, _, f in parts] == ["0", "x*(x + 3)/6", "x"]
    for lo, hi, f in parts:
        grid = np.linspace(max(lo, -9.0), min(hi, 9.0), 101)[1:-1]
        assert np.allclose(sp.lambdify(x, f, "numpy")(grid) * np.ones_like(grid), act.f(grid), rtol=1e-15, atol=0)


def test_a_unit_step_of_a_cancelling_argument_is_made_exact():
    """ELU's derivative eˣ·H(1 − eˣ) is ½ at x = −1e-17 in float64 (1 − eˣ rounds to 0); written eˣ·H(−x) it is 1."""
    elu = get_activation("elu")
    assert sharpen(sp.exp(x) * sp.Heaviside(1 - sp.exp(x))) == sp.exp(x) * sp.Heaviside(-x)
    assert np.array_equal(elu.df(np.array([-1e-17, 0.0, 1e-17])), [1.0, 1.0, 1.0])
