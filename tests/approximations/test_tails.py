"""Tails of any kind (approximations.tails): exponential, double exponential (TanhExp) and algebraic (squareplus)
residuals are told apart from samples, their mass beyond a point matches an independent mpmath integral to
infinity, the interval rule never evaluates at infinity, and an activation whose tail the rule cannot bound is
refused with its true reason and fitted on a given interval."""

import math

import mpmath
import numpy as np
import pytest
from approxbp.approximations import get_activation
from approxbp.approximations.tails import mass_beyond, tail
from approxbp.fitting.objective import interval_for

TANHEXP, SQUAREPLUS = "x*tanh(exp(x))", "(x + sqrt(x**2 + 4))/2"
SERF, LOGISH = "x*erf(log(1+exp(x)))", "x*log(1 + sigmoid(x))"


@pytest.mark.parametrize("expression, order, side, kind, power", [
    (TANHEXP, 0, "left", "fast", None), (TANHEXP, 0, "right", "fast", None), (TANHEXP, 1, "right", "fast", None),
    (SQUAREPLUS, 0, "left", "algebraic", 1.0), (SQUAREPLUS, 0, "right", "algebraic", 1.0),
    (SQUAREPLUS, 1, "left", "algebraic", 2.0), (SERF, 0, "left", "fast", None), (LOGISH, 0, "right", "none", None),
    ("gelu", 0, "right", "fast", None), ("x/(1 + x**2) + x*sigmoid(x)", 0, "left", "algebraic", 1.0),
])
def test_tails_are_told_apart(expression, order, side, kind, power):
    t = tail(get_activation(expression), order, side)
    assert t.kind == kind
    if power is not None:
        assert t.power == pytest.approx(power, abs=0.01)


@pytest.mark.parametrize("expression, order, side, at", [(SQUAREPLUS, 0, "left", 64.0), (SQUAREPLUS, 1, "right", 3.0),
                                                         ("mish", 0, "left", 10.0), ("gelu_tanh", 1, "right", 2.0)])
def test_the_mass_beyond_a_point_matches_an_integral_to_infinity(expression, order, side, at):
    act = get_activation(expression)
    sign = -1 if side == "left" else 1

    def t(v):
        value = act.mp(sign * v, order, None)
        return value if side == "left" else value - (sign * v if order == 0 else 1)
    with mpmath.workdps(40):
        want = float(mpmath.quad(lambda v: t(v) ** 2, [at, 10 * at, mpmath.inf]))
    assert mass_beyond(act, tail(act, order, side), at) == pytest.approx(want, rel=1e-4)


def test_a_double_exponential_gets_an_interval_without_exhausting_memory():
    for objective in ("primitive", "derivative"):
        a, b, mass, how = interval_for(get_activation(TANHEXP), objective)
        assert -30 < a < -15 and 2 < b < 3 and mass <= 1e-16 and "numerical" in how
    rewritten = get_activation("x*(1-2/(exp(2*exp(x))+1))")  # e^(2eˣ) overflows float64 at x ≈ 5.86
    grid = np.linspace(-30, 30, 601)
    assert np.allclose(rewritten.df(grid), get_activation(TANHEXP).df(grid), rtol=1e-9, atol=1e-300)


@pytest.mark.slow
def test_an_algebraic_tail_gets_a_default_interval_whose_outside_mass_is_a_constant():
    """Squareplus' residual falls like 1/|x|: no interval holds the tail rule, but beyond the outermost knot h̃ is
    exactly 0 or x, so the mass outside any interval past the knots is a constant of the loss: ±64 by default, the
    report says so, and a wider interval gives the same knots and the same loss + outside mass (issue 47)."""
    from approxbp.fitting.relu_sum import fit_relu_sum

    act = get_activation(SQUAREPLUS)
    act.check_relu_sum_asymptotics()  # it does tend to 0, like 1/|x|
    a, b, mass, how = interval_for(act, "primitive")
    assert (a, b) == (-64.0, 64.0) and "algebraic" in how and "constant" in how
    assert mass == pytest.approx(2 * 1 / 64, rel=0.05)  # (h − x)² ~ 1/x² beyond ±64 on each side
    fits = [fit_relu_sum(act, 2, "primitive", restarts=2, workers=1, progress=False, interval=i).table
            for i in (None, (-128.0, 128.0))]
    assert np.allclose(fits[0].knots, fits[1].knots, atol=1e-6)
    whole = [t.loss + t.metrics["tail_mass"] for t in fits]
    assert whole[0] == pytest.approx(whole[1], rel=1e-6)
    a, b, mass, how = interval_for(act, "primitive", (-20.0, 20.0))
    assert (a, b) == (-20.0, 20.0) and mass == pytest.approx(2 * 1 / 20, rel=0.05) and "given" in how
    with pytest.raises(ValueError, match="expected finite A < 0 < B"):
        interval_for(act, "primitive", (1.0, 2.0))


def test_every_eq_13_refusal_names_a_way_forward_that_runs(capsys):
    """An activation eq. 13 cannot match (h → −1 on the left, as log(1 + eˣ) − 1) is refused with the signed value,
    the exact InvAct fit (it increases) and the free-level command; an InvAct refusal (Smish's tail rule) with the
    family that fits it; every command named runs (issue 47)."""
    import re
    import shlex

    from approxbp.cli import main

    for expression, fit, named in (("log(1+exp(x)) - 1", ["relu-sum", "--bits", "2"], 2),
                                   ("x*tanh(log(1+1/(1+exp(-x))))", ["invact"], 1)):
        assert main(["fit", *fit, "--activation", expression, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "A way forward: " in err and "approxbp fit relu-sum --levels free" in err, err
        if expression.startswith("log"):
            assert "h does not tend to 0 (−1 at x = −512)" in err
            assert "A way forward: approxbp fit invact --activation" in err  # it increases: one exact branch
        commands = re.findall(r"(approxbp fit [^']*'[^']*'(?: --bits \d+)?)", err.split("A way forward: ")[1])
        assert len(commands) == named, commands
        for command in commands:
            assert main([*shlex.split(command)[1:], "--no-progress"]) == 0, command
            out = capsys.readouterr().out
            assert ("free levels" if "--levels free" in command else "form=exact") in out, out


def test_logish_is_refused_for_its_true_reason():
    """x·log(1 + σ(x)) grows like x·log 2 on the right: h − x does not vanish (eq. 13 cannot match it)."""
    with pytest.raises(ValueError, match="h − x does not tend to 0"):
        get_activation(LOGISH).check_relu_sum_asymptotics()
    slow = get_activation("x*sigmoid(x) + (1 + x**2)**(-0.25)")  # tends to 0 like |x|^−½: its square is not ∫-able
    t = tail(slow, 0, "left")
    assert t.kind == "algebraic" and math.isclose(t.power, 0.5, abs_tol=0.01) and not t.square_integrable
    with pytest.raises(ValueError, match="is infinite"):
        interval_for(slow, "primitive")


def test_the_cli_fits_an_algebraic_tail_on_a_given_interval(tmp_path):
    from approxbp.approximations.tables import load

    from approxbp.cli import main

    out = tmp_path / "sq.json"
    assert main(["fit", "relu-sum", "--activation", SQUAREPLUS, "--name", "squareplus", "--bits", "2",
                 "--interval", "-20", "20", "--restarts", "1", "--workers", "1", "--no-progress",
                 "--out", str(out)]) == 0
    table = load(out)
    assert table.interval == (-20.0, 20.0) or list(table.interval) == [-20.0, 20.0]
    assert "given" in table.metrics["interval_rule"] and table.metrics["tail_mass"] > 0.09
