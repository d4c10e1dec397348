"""ReLU-sum fits of a piecewise activation (issue 47): hard-swish x·min(max(x + 3, 0), 6)/6 is 0 below −3 and x
above 3, so eq. 13 holds; the quadrature splits its panels at the kinks, the tail rule's interval is widened when
the optimum's knots lie on its ends, the certifier integrates piece by piece, and the drop-in replaces
nn.Hardswish. Every loss is checked against an independent mpmath quadrature split at the kinks and knots."""

import copy

import mpmath
import numpy as np
import pytest
import torch
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.fitting.optimality import relu_sum_objective
from approxbp.fitting.relu_sum import fit_relu_sum
from approxbp.kernels import ReLUSumActivation, patch_model
from torch import nn


def _loss_by_mpmath(t) -> float:
    """∫_A^B (h − h̃)² (primitive) or (h′ − h̃′)² (derivative), mpmath quad on pieces between kinks and knots."""
    act, order = get_activation(t.expression), 0 if t.objective == "primitive" else 1
    a, b = t.interval
    points = sorted({a, b, *(p for p in (*t.knots, *act.kinks()) if a < p < b)})

    def residual(v):
        fit = sum(w * (max(0, v - c) if order == 0 else float(v > c)) for w, c in zip(t.weights, t.knots))
        return act.mp(v, order, None) - fit
    with mpmath.workdps(30):
        return float(mpmath.quad(lambda v: residual(v) ** 2, points))


@pytest.mark.parametrize("objective", ["primitive", "derivative"])
def test_the_packaged_hardswish_tables_are_the_widened_optima(objective):
    t = table_files.load(f"relu_sum/hardswish-k2-{objective}")
    assert t.loss == pytest.approx(_loss_by_mpmath(t), rel=1e-12)
    assert tuple(t.interval) == (-6.0, 6.0) and "a knot lay on an end" in t.metrics["interval_rule"]
    if objective == "primitive":  # the optimum lies outside the kinks: the narrowest interval [−3, 3] would cut it
        assert np.allclose(t.knots, [-4.5, 0.0, 4.5], atol=1e-8) and t.loss == pytest.approx(7 / 60, rel=1e-12)
    enclosure = relu_sum_objective(t)
    assert enclosure.lower() <= t.loss * (1 + 1e-12) and t.loss * (1 - 1e-12) <= enclosure.upper()
    assert float(enclosure.rad()) < 1e-14


def test_kinks_inside_the_quadrature_panels_are_split_at():
    """On a given interval whose panels hold both kinks, the fitted loss equals mpmath's to 1e-12."""
    t = fit_relu_sum("hardswish", 2, "primitive", restarts=2, workers=1, progress=False, interval=(-4.3, 5.1)).table
    assert t.loss == pytest.approx(_loss_by_mpmath(t), rel=1e-12)


def test_patch_model_swaps_nn_hardswish_for_its_relu_sum_drop_in():
    """Forward exact, gradient the table's h̃′ = Σ w·[x > c] (independently summed), saving 2 bits for 32."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 64), nn.Hardswish(), nn.Linear(64, 1))
    model = copy.deepcopy(stock)
    x = torch.randn(32, 8)
    report = patch_model(model, family="relu-sum", example_input=x)
    assert isinstance(model[1], ReLUSumActivation), report
    assert report.saved_bytes[1] < report.saved_bytes[0], report
    h = stock[0](x).detach().requires_grad_()
    y = model[1](h)
    torch.testing.assert_close(y, nn.functional.hardswish(h), rtol=1e-6, atol=1e-6)
    y.backward(torch.ones_like(y))
    t = table_files.load("relu_sum/hardswish-k2-primitive")
    want = sum(w * (h.detach().double() > c).double() for w, c in zip(t.weights, t.knots))
    torch.testing.assert_close(h.grad.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_invact_refuses_hardswish_naming_the_relu_sum_fit_that_runs(capsys):
    """The fitted InvAct forms need a smooth h: hard-swish is refused in one line (it ended in 'no fast form reaches
    3e-07 … use form=newton'), naming the ReLU-sum command, which runs."""
    import shlex

    from approxbp.cli import main

    assert main(["fit", "invact", "--activation", "hardswish", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "piecewise (kinks at x = -3, 3)" in err and "A way forward: approxbp fit relu-sum" in err, err
    command = shlex.split(err.split("A way forward: ")[1].split(" (")[0])
    assert main([*command[1:], "--restarts", "1", "--workers", "1", "--no-progress"]) == 0


@pytest.mark.slow
def test_a_users_piecewise_hardswish_fits_as_the_registered_one(tmp_path):
    """Typed with Piecewise, hard-swish gets the registered one's optimum (same knots, same loss) and its table reads
    back (the stored expression is in selects, which the activation grammar accepts)."""
    user = "Piecewise((0, x < -3), (x, x > 3), (x*(x + 3)/6, True))"
    t = fit_relu_sum(user, 2, "primitive", restarts=2, workers=1, progress=False).table
    packaged = table_files.load("relu_sum/hardswish-k2-primitive")
    assert t.loss == pytest.approx(packaged.loss, rel=1e-12) and np.allclose(t.knots, packaged.knots, atol=1e-8)
    path = tmp_path / "user-hardswish.json"
    table_files.save(t, path)
    assert table_files.load(path).expression == t.expression
