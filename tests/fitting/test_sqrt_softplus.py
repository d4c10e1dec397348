"""DeepSeek-V4's SqrtSoftplus, h(x) = √softplus(x): fitted where its asymptotics allow, refused with the reason
elsewhere. h′ → 0 on both sides (h grows like √x), so eq. 13's constrained ReLU-sum (h − x → 0 as x → ∞) does not
apply; FewBit's free-level family on a finite interval does, and, h being increasing with inf 0, InvAct's exact
one-branch table does."""

import numpy as np
import pytest
from approxbp.approximations.invact_forms import Form
from approxbp.fitting.free_levels import fit_free_levels
from approxbp.fitting.invact import fit_invact
from approxbp.fitting.relu_sum import fit_relu_sum
from scipy.integrate import quad

SQRT_SOFTPLUS = "sqrt(log(1+exp(x)))"


def test_the_constrained_family_is_refused_with_the_tail_reason():
    with pytest.raises(ValueError, match=r"h − x does not tend to 0 \(−489\.37"):
        fit_relu_sum(SQRT_SOFTPLUS, bits=2, progress=False)


def test_inverted_activation_is_exact_and_one_branch_for_this_increasing_function():
    """√softplus increases with inf 0: f′(f⁻¹(y)) = (1 − e^(−y²))/(2y) in closed form (sympy), one branch, no bit;
    checked against h′ at x where y = h(x)."""
    t = fit_invact(SQRT_SOFTPLUS, progress=False).table
    # 1 − e^(−y²) cancels as y → 0 (expm1 is written e^u − 1), so float64 keeps ~1e-16 absolute, /2y: L∞ 3.5e-9
    assert t.monotone and t.form == "exact" and t.metrics["linf_right"] < 1e-8
    assert str(t.right.expression) == "(1 - exp(-y**2))/(2*y)"
    x = np.linspace(-30.0, 30.0, 601)
    y = np.sqrt(np.logaddexp(0.0, x))
    want = 0.5 / (1 + np.exp(-x)) / y
    got = Form.from_table(t.right)(y)
    assert np.allclose(got, want, rtol=1e-9, atol=1e-8)
    with pytest.raises(ValueError, match="exactly two monotone branches"):
        fit_invact(SQRT_SOFTPLUS, "fast", progress=False)


def test_free_levels_fit_and_their_loss_is_the_integral():
    fit = fit_free_levels(SQRT_SOFTPLUS, 2, interval=(-20.0, 20.0), restarts=2)
    softplus = lambda x: np.logaddexp(0.0, x)  # noqa: E731
    dh = lambda x: 0.5 / (1 + np.exp(-x)) / np.sqrt(softplus(x))  # noqa: E731
    edges = [-20.0, *fit.borders, 20.0]
    levels = np.asarray(fit.levels)
    # each level is h′'s mean over its segment (the optimum for fixed borders), and the loss is ∫(h′ − q)²
    for lo, hi, q in zip(edges, edges[1:], levels):
        assert q == pytest.approx((np.sqrt(softplus(hi)) - np.sqrt(softplus(lo))) / (hi - lo), rel=1e-9)
    loss = sum(quad(lambda x, q=q: (dh(x) - q) ** 2, lo, hi, epsabs=1e-13, epsrel=1e-12)[0]
               for lo, hi, q in zip(edges, edges[1:], levels))
    assert fit.loss == pytest.approx(loss, rel=1e-7) and loss < 0.03  # measured 2.642e-2 (k = 2)
