"""fitting/objectives_k2.py: the k = 2 objectives with the levels projected out in closed form equal the fitter's
own objective (Gauss–Legendre + tridiagonal solve), and their antiderivatives scipy's quadrature."""

import numpy as np
import pytest
from _k2_tables import k2
from approxbp.approximations import get_activation
from approxbp.fitting import intervals as iv
from flint import arb


def test_k2_closed_form_equals_the_fitting_objective():
    t, J, obj, rng = k2("silu", "derivative", 2)
    for _ in range(20):
        c = np.sort(rng.uniform(-4, 4, 3))
        val = J.value(arb(c[0]), arb(c[1] - c[0]), arb(c[2] - c[1]))
        assert abs(float(val.mid()) - obj(c)[0]) <= 1e-9 * obj(c)[0]


@pytest.mark.parametrize("name", [pytest.param("gelu", marks=pytest.mark.slow), "silu"])
@iv.at_precision  # the certifier's working precision, as certify_relu_sum_global runs the objective
def test_k2_primitive_closed_form_equals_the_fitting_objective_and_scipy(name):
    """The projected primitive objective (one free value at c₂, closed form in the antiderivatives of h, x·h, h²)
    against the fitter's own objective (Gauss–Legendre + tridiagonal solve) and the antiderivatives against quad."""
    from scipy.integrate import quad

    t, J, obj, rng = k2(name, "primitive", 4)
    for _ in range(20):
        c = np.sort(rng.uniform(t.interval[0] / 2, t.interval[1] / 2, 3))
        val, grad = J.value_gradient(*(arb(v) for v in c))
        assert abs(float(val.mid()) - obj(c)[0]) <= 1e-9 * obj(c)[0] and float(val.rad()) < 1e-15
    h = get_activation(name).f
    for name_g, weight in zip(J.G, (lambda v: h(v), lambda v: v * h(v), lambda v: h(v) ** 2)):
        z = 0.37 * t.interval[1]
        ref = quad(lambda v, w=weight: float(w(v)), t.interval[0], z, epsabs=1e-14, epsrel=1e-13, limit=200)[0]
        assert abs(float(J._G(name_g, arb(z)).mid()) - ref) <= 1e-11 * max(1.0, abs(ref))
