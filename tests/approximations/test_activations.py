import math

import mpmath
import numpy as np
import pytest
import torch
from approxbp.approximations import REGISTRY, get_activation

NAMES = list(REGISTRY)
POINTS = [-30.0, -7.5, -2.0, -0.3, 0.0, 0.4, 1.7, 6.0, 25.0]


@pytest.mark.parametrize("name", NAMES)
def test_numpy_and_torch_match_mpmath(name):
    act = get_activation(name)
    xs = np.array(POINTS)
    for order, np_fn in ((0, act.f), (1, act.df), (2, act.d2f)):
        ref = np.array([float(act.mp(v, order)) for v in xs])
        # h'' (used only to seed knot densities) loses digits to cancellation in the tails: absolute 1e-14
        assert np.allclose(np_fn(xs), ref, rtol=5e-14, atol=1e-15 if order < 2 else 1e-14), (name, order)
        if order < 2:
            got = act.torch_fn(order)(torch.tensor(xs, dtype=torch.float64)).numpy()
            assert np.allclose(got, ref, rtol=5e-14, atol=1e-15), (name, order)


def test_gelu_is_the_erf_form_of_eq_40():
    act = get_activation("GELU")
    for v in (-1.3, 0.2, 2.5):
        assert act.mp(v) == pytest.approx(float(v / 2 * (1 + mpmath.erf(v / mpmath.sqrt(2)))), rel=1e-15)
    assert get_activation("silu").f(np.array([1.0]))[0] == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-15)


def test_user_expression_is_parsed_and_differentiated():
    act = get_activation("x*tanh(log(1+exp(x)))")
    mish = get_activation("mish")
    xs = np.linspace(-5, 5, 11)
    assert np.allclose(act.df(xs), mish.df(xs), rtol=1e-14)


def test_unknown_name_lists_registry():
    with pytest.raises(ValueError, match="named: gelu, gelu_tanh"):
        get_activation("swishy")


@pytest.mark.parametrize("text,where", [("x*(1+", "column"), ("x**", "column")])
def test_unparsable_expression_says_where(text, where):
    with pytest.raises(ValueError, match=where):
        get_activation(text)


def test_foreign_symbols_and_unknown_functions_are_refused():
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['y'\]"):
        get_activation("x*y")
    with pytest.raises(ValueError, match="unknown name"):
        get_activation("foo(x)")
    with pytest.raises(TypeError):
        get_activation(3.0)


@pytest.mark.parametrize("text", ["tanh", "x", "exp(x)", "x*erf(x)"])
def test_relu_sum_asymptotics_refusal(text):
    act = get_activation(text)
    with pytest.raises(ValueError, match="cannot be approximated by a sum of ReLUs"):
        act.check_relu_sum_asymptotics()


@pytest.mark.parametrize("name", NAMES)
def test_registry_has_relu_sum_asymptotics(name):
    get_activation(name).check_relu_sum_asymptotics()


def test_a_custom_activation_gets_a_name_and_keeps_its_expression(tmp_path):
    from approxbp.approximations.activations import named_activation
    from approxbp.approximations.tables import load

    from approxbp.cli import main

    act = named_activation("x*sigmoid(1.5*x)", "swish1.5")
    assert act.name == "swish1.5" and act.expr == get_activation("x*sigmoid(1.5*x)").expr
    assert named_activation("x*Phi(x)", "gelu").name == "gelu"  # the registry's own function may keep its name
    with pytest.raises(ValueError, match="registry"):
        named_activation("x*sigmoid(1.5*x)", "silu")
    for bad in ("bad name", "1x", "a/b", "x" * 65):
        with pytest.raises(ValueError, match="must match"):
            named_activation("x*sigmoid(x)", bad)
    out = tmp_path / "swish.json"
    assert main(["fit", "relu-sum", "--activation", "x*sigmoid(1.5*x)", "--name", "swish1.5", "--bits", "1",
                 "--restarts", "1", "--workers", "1", "--no-progress", "--out", str(out)]) == 0
    t = load(out)
    assert t.activation == "swish1.5" and t.name == "swish1.5-k1-primitive"


def test_softplus_log1p_expm1_are_in_the_grammar():
    assert get_activation("x*tanh(softplus(x))").expr == get_activation("mish").expr  # HF writes Mish this way
    assert get_activation("softplus").expr == get_activation("log(1 + exp(x))").expr
    assert get_activation("x*log1p(x*x)").expr == get_activation("x*log(1 + x**2)").expr
    v = np.array([-3.0, 0.5, 4.0])
    np.testing.assert_allclose(get_activation("x*expm1(-x*x)").f(v), v * np.expm1(-v * v), rtol=1e-15)
    assert get_activation("x*tanh(softplus(x))").f(np.array([800.0]))[0] == 800.0  # no overflow


def test_a_users_gelu_is_generated_from_the_packaged_form():
    """x·erfc(−x/√2)/2, which sympy turns into the cancelling x·(2 − erfc(x/√2))/2 (0 at x = −12 where GELU is
    −2e-32), is the packaged x·Φ(x): evaluated, fitted and generated from it, so its kernel costs what ReGELU2's
    does (issue 47). A function that differs by 1e-7 is not taken for GELU; the user's label stays."""
    import numpy as np
    from approxbp.approximations import get_activation
    from approxbp.approximations.activations import known_form

    gelu = get_activation("gelu")
    for text in ("x*erfc(-x/sqrt(2))/2", "x*(1 + erf(x/sqrt(2)))/2", "0.5*x*(1 + erf(0.7071067811865476*x))"):
        act = get_activation(text)
        assert act.expr == gelu.expr and act.name == text, text
    assert get_activation("x/(1 + exp(-x))").expr == get_activation("silu").expr
    assert known_form("x*Phi(x)*1.0000001") is None and known_form("x*tanh(exp(x))") is None
    assert get_activation("x*erfc(-x/sqrt(2))/2").f(np.array([-12.0]))[0] < 0  # no cancellation to 0


def test_stable_form_rewrites_exactly_one_plus_exp_and_one_plus_tanh():
    """The structural rules of stable_form take 1 + eᵘ inside a log and 1 + tanh(u) (the 1 may be a Float, the terms
    in either order) and leave every other sum alone."""
    import sympy as sp
    from approxbp.approximations.functions import sigmoid, softplus
    from approxbp.approximations.rewrites import stable_form

    x = sp.Symbol("x")
    assert stable_form(sp.log(sp.exp(-x) + 1)) == softplus(-x)
    assert stable_form(sp.log(sp.Float(1.0) + sp.exp(2 * x))) == softplus(2 * x)
    assert stable_form(x * (1 + sp.tanh(x))) == x * 2 * sigmoid(2 * x)
    for kept in (sp.log(2 + sp.exp(x)), sp.log(1 + 2 * sp.exp(x)), sp.log(1 + x + sp.exp(x)), sp.log(2),
                 2 + sp.tanh(x), 1 + x + sp.tanh(x), 1 + 2 * sp.tanh(x)):
        assert stable_form(kept) == kept, kept
