"""The objective against independent references: scipy quad, finite differences, torch autograd, mpmath."""

import math

import numpy as np
import pytest
import torch
from approxbp.approximations import ReLUSum, get_activation
from approxbp.fitting import ReluSumObjective, interval_for
from approxbp.fitting.relu_sum import torch_objective
from hypothesis import given
from hypothesis import strategies as st
from scipy.integrate import quad

CASES = [(a, o) for a in ("gelu", "silu", "mish") for o in ("primitive", "derivative")]


def _quad_loss(act, rs, objective, A, B):
    pts = [c for c in rs.knots if A < c < B]
    f = (lambda v: (act.f(v) - rs(v)) ** 2) if objective == "primitive" else \
        (lambda v: (act.df(v) - rs.derivative(np.array([v]))[0]) ** 2)
    edges = [A, *pts, B]
    return sum(quad(f, lo, hi, epsabs=0, epsrel=1e-13, limit=200)[0] for lo, hi in zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("name,objective", CASES)
@given(data=st.data())
def test_loss_matches_scipy_quad(name, objective, data):
    act = get_activation(name)
    A, B, *_ = interval_for(act, objective)
    k = data.draw(st.integers(2, 3))
    c = np.sort(np.array(data.draw(st.lists(st.floats(-4, 4), min_size=2**k - 1, max_size=2**k - 1, unique=True))))
    w = np.array(data.draw(st.lists(st.floats(-1, 1), min_size=c.size, max_size=c.size)))
    rs = ReLUSum(w, c)
    obj = ReluSumObjective(act, k, objective, (A, B))
    ref = _quad_loss(act, rs, objective, A, B)
    assert obj.loss(rs) == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize("name,objective", CASES)
@pytest.mark.parametrize("k", [2, 3, 5])
def test_gradient_matches_finite_differences(name, objective, k):
    act = get_activation(name)
    obj = ReluSumObjective(act, k, objective, interval_for(act, objective)[:2])
    c = np.random.default_rng(k).uniform(-3, 3, 2**k - 1)
    _, g = obj(c)
    h = 1e-6
    fd = np.array([(obj(c + e)[0] - obj(c - e)[0]) / (2 * h) for e in np.eye(c.size) * h])
    assert np.max(np.abs(g - fd)) <= 1e-6 * max(1.0, np.max(np.abs(g)))


@pytest.mark.parametrize("name,objective", [("gelu", "primitive"), ("silu", "derivative")])
def test_torch_autograd_objective_agrees(name, objective):
    act = get_activation(name)
    obj = ReluSumObjective(act, 3, objective, interval_for(act, objective)[:2])
    c = np.random.default_rng(0).uniform(-3, 3, 7)
    J, g = obj(c)
    ct = torch.tensor(c, requires_grad=True)
    Jt = torch_objective(obj, panels=64)(ct)
    Jt.backward()
    assert float(Jt) == pytest.approx(J, rel=1e-9)
    assert np.allclose(ct.grad.numpy(), g, rtol=1e-6, atol=1e-9)


def test_variable_projection_value_equals_direct_loss(gelu):
    obj = ReluSumObjective(gelu, 4, "primitive", interval_for(gelu, "primitive")[:2])
    c = np.linspace(-3, 3, 15)
    assert obj(c)[0] == pytest.approx(obj.loss(obj.solution(c)), rel=1e-12)


def test_paper_intervals_eqs_45_and_51():
    A, B, tail, _ = interval_for(get_activation("gelu"), "primitive")
    assert B == -A == pytest.approx(math.sqrt(-2 * math.log(1e-8)))
    assert tail < 1e-8
    A, B, tail, _ = interval_for(get_activation("silu"), "primitive")
    assert B == -A == pytest.approx(-2 * math.log(0.5e-8))
    assert tail < 1e-8


@pytest.mark.slow
def test_numerical_interval_bounds_tail_for_other_activations():
    for name in ("gelu_tanh", "mish"):
        for objective in ("primitive", "derivative"):
            A, B, tail, how = interval_for(get_activation(name), objective)
            assert tail <= 1e-8 and A < 0 < B and "numerical" in how


def test_the_numerical_interval_is_the_narrowest_in_thousandths():
    """Each end is the least multiple of 0.001 whose tail beyond it is ≤ ε/2 = 5e-17: 0.001 nearer, the tail is over
    it (the residual's mass by 30-digit quadrature, its own tail classified afresh)."""
    from approxbp.approximations.tails import mass_beyond, tail

    act = get_activation("mish")
    A, B, _, _ = interval_for(act, "primitive")
    for side, end in (("left", -A), ("right", B)):
        shape = tail(act, 0, side)
        assert round(end * 1000) == end * 1000
        assert mass_beyond(act, shape, end) <= 5e-17 < mass_beyond(act, shape, end - 0.001), (side, end)


ALGEBRAIC = "x*(1+x/sqrt(1+x**2))/2"  # h ~ −1/(4x) on the left, h − x ~ 1/(4x) on the right
#: Its k = 3 primitive optimum on [−256, 256] (approxbp fit relu-sum --bits 3, before the graded panels).
ALGEBRAIC_KNOTS = np.array([-184.14469136, -21.44133292, -4.90090583, -0.34649451, 0.30531302, 6.33320626,
                            55.11323221])


def _mp_objective(obj: ReluSumObjective, c: np.ndarray) -> float:
    """E(w, c) of the objective's optimal h̃ for knots c, by mpmath quadrature at 30 digits piece by piece."""
    import mpmath

    rs = obj.solution(c)
    act = obj.activation
    with mpmath.workdps(30):
        knots, weights = [mpmath.mpf(float(v)) for v in rs.knots], [mpmath.mpf(float(v)) for v in rs.weights]

        def residual(x):
            return act.mp(x, 0, None) - sum(w * max(x - k, 0) for w, k in zip(weights, knots))

        breaks = [obj.A, *map(float, rs.knots), obj.B]
        return float(sum(mpmath.quad(lambda x: residual(x) ** 2, [a, b]) for a, b in zip(breaks[:-1], breaks[1:])))


def test_graded_panels_for_an_algebraic_tail_are_exact_with_fewer_nodes():
    """Issue 60: a k = 3 fit of an activation with an algebraic tail took minutes on [−256, 256] of 0.5-wide panels.
    Beyond |x| = 8 the panels widen with |x| (the tail varies on that scale): 2.4× fewer nodes, and the objective of
    each quadrature's own optimum h̃ agrees with 30-digit mpmath as closely as the uniform panels' does (1e-12
    relative: the float64 floor of h − h̃ where |h| reaches 256)."""
    from approxbp.fitting.objective import quadrature

    obj = ReluSumObjective(ALGEBRAIC, 3, "primitive", (-256.0, 256.0))
    assert obj.graded
    graded, graded_exact = obj(ALGEBRAIC_KNOTS)[0], _mp_objective(obj, ALGEBRAIC_KNOTS)
    obj.graded = False
    uniform, uniform_exact = obj(ALGEBRAIC_KNOTS)[0], _mp_objective(obj, ALGEBRAIC_KNOTS)
    assert abs(graded - graded_exact) <= 1e-11 * graded_exact, (graded, graded_exact)
    assert abs(uniform - uniform_exact) <= 1e-11 * uniform_exact, (uniform, uniform_exact)
    assert abs(graded - uniform) <= 1e-11 * uniform  # the same fit, whichever panels
    breaks = np.concatenate([[-256.0], ALGEBRAIC_KNOTS, [256.0]])
    assert 2 * quadrature(breaks, graded=True)[0].size < quadrature(breaks)[0].size
    x, w, s, tau = quadrature(breaks, graded=True)
    assert np.allclose(np.bincount(s, w), np.diff(breaks), rtol=1e-14)  # each segment's nodes integrate 1 exactly
    assert np.all((x > -256) & (x < 256)) and np.all((tau >= 0) & (tau <= 1))


@pytest.mark.parametrize("expression, graded", [("gelu", False), ("silu", False), ("mish", False),
                                                ("(x + sqrt(x**2 + 4))/2", True), (ALGEBRAIC, True)])
def test_only_algebraic_tails_get_graded_panels(expression, graded):
    """Every other activation keeps its uniform panels, so its fits and committed tables are unchanged."""
    for objective in ("primitive", "derivative"):
        A, B, *_ = interval_for(get_activation(expression), objective)
        assert ReluSumObjective(expression, 2, objective, (A, B)).graded is graded


@pytest.mark.slow
def test_a_k3_fit_with_algebraic_tails_reaches_the_optimum_through_its_widenings(capsys):
    """The tail rule's [−64, 64] doubled twice (a knot on an end each time), each widening said on stderr; the loss
    is the 30-digit objective of the earlier optimum (3.1058500663474e-3) or lower, up to the float64 floor of its
    evaluation (1e-11 relative). Its time is the benchmark's (benchmarks/fit_relu_sum.py), not a test's."""
    from approxbp.fitting import fit_relu_sum

    fit = fit_relu_sum(ALGEBRAIC, 3, "primitive", seed=0, progress=True)
    err = capsys.readouterr().err
    assert tuple(fit.table.interval) == (-256.0, 256.0) and err.count("a knot lay on an end of") == 2, err
    earlier = _mp_objective(ReluSumObjective(ALGEBRAIC, 3, "primitive", (-256.0, 256.0)), ALGEBRAIC_KNOTS)
    assert fit.table.loss <= earlier * (1 + 1e-11)
