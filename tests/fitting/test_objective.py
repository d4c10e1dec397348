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


def test_numerical_interval_bounds_tail_for_other_activations():
    for name in ("gelu_tanh", "mish"):
        for objective in ("primitive", "derivative"):
            A, B, tail, how = interval_for(get_activation(name), objective)
            assert tail <= 1e-8 and A < 0 < B and "numerical" in how
