"""The `fast` inverted-activation form — L∞ ≤ 1e-6 on both branches, at most two transcendental and 48
other (fused) operations per element for both branches together, identical in the twin and the kernel."""

import numpy as np
import pytest
import sympy as sp
import torch
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.invact import InvertedActivation
from approxbp.approximations.invact_forms import Form
from approxbp.fitting.invact_fast import b, branch, fused_operations
from approxbp.kernels import InvActGELU, InvActivation, InvActSiLU

ACTS = ["gelu", "silu", "gelu_tanh", "quick_gelu", "mish"]


def _load(act):
    t = table_files.load(f"invact/{act}-fast")
    return t, Form.from_table(t.combined, ("y", "b"))


@pytest.mark.parametrize("act", ACTS)
def test_fast_form_is_within_1e6_everywhere(act):
    t, combined = _load(act)
    assert max(t["metrics"]["linf_left"], t["metrics"]["linf_right"]) <= 1e-6
    ia = InvertedActivation(get_activation(act))
    yl = np.concatenate([np.linspace(ia.f_T, 0.0, 40001)[:-1], -np.geomspace(1e-300, 1e-2, 2000)])
    yr = np.concatenate([np.linspace(ia.f_T, ia.f_T + 30.0, 60001), np.geomspace(30.0, 1e4, 2000)])
    for side, yv in (("left", yl), ("right", yr)):
        q = branch(combined, side)(yv)
        assert np.max(np.abs(q - ia.g(yv, side))) <= 1e-6, side


@pytest.mark.parametrize("act", ACTS)
def test_fast_form_operation_budget(act):
    t, combined = _load(act)
    trans, other = fused_operations(combined)
    assert trans <= 2 and other <= 48, (trans, other)
    assert (t["metrics"]["fast"]["transcendental_ops"], t["metrics"]["fast"]["other_ops"]) == (trans, other)
    funcs = {type(f).__name__ for e in [combined.expression, *(v for _, v in combined.assignments)]
             for f in e.atoms(sp.Function)}
    assert funcs <= {"select", "Max", "log"}, funcs  # √ is a power; no erf/exp


def test_combined_form_is_both_branch_forms():
    t, combined = _load("gelu")
    yv = np.linspace(t["f_T"], 0, 1001)
    assert np.array_equal(Form.from_table(t.left)(yv), branch(combined, "left")(yv))
    assert combined.expression.has(b)


def test_fast_is_the_default_and_its_kernel_matches_the_twin():
    assert InvActGELU().spec.table["form"] == "fast" and InvActSiLU().spec.table["form"] == "fast"
    x = torch.cat([torch.linspace(-12, 12, 2049), torch.tensor([0.0, -0.7517915, float("nan")])])
    g = torch.randn_like(x)
    for act in ACTS:
        twin, kernel = InvActivation(f"{act}-fast"), InvActivation(f"{act}-fast", use_triton=True)
        grads = []
        for m in (twin, kernel):
            xi = x.clone().requires_grad_(True)
            m(xi).backward(g)
            grads.append(xi.grad)
        assert torch.equal(grads[0].isnan(), grads[1].isnan())
        # y itself is rounded differently (the twin's Φ is erfc-based, the kernel's 1 + erf), and q has a square-root
        # singularity at f(T): there both are within the documented fp32 limit of 1e-4 (README), not of each other
        assert torch.allclose(grads[0].nan_to_num(), grads[1].nan_to_num(), atol=1e-4 * g.abs().max(), rtol=0)
        exact = torch.func.grad(lambda v: torch.nn.functional.gelu(v).sum())(x.double()) if act == "gelu" else None
        if exact is not None:
            ok = ~x.isnan()
            assert (grads[0][ok].double() - exact[ok] * g[ok].double()).abs().max() <= 1e-4 * g.abs().max()


BUMPED_SILU = "x*sigmoid(x)*(1+exp(-x**2)/10)"  # no rational of degree ≤ 12 reaches the fast form's tolerance


@pytest.mark.slow
def test_auto_refuses_the_fast_form_in_one_fit_and_falls_to_newton_saying_so(monkeypatch, capsys):
    """Issue 60: `fit invact` (--form auto) searched 24 rational fits (175 s) on an activation with no fast form and
    then refused with Python syntax (use form='newton'). The top degree on the narrowest split is a cheap bound:
    one rational fit (counted: a budget in work, not seconds), then the newton form, said on stderr and in the
    table's provenance; --form fast refuses naming the CLI's own command, which runs."""
    import shlex

    from approxbp.fitting import invact_fast as F
    from approxbp.fitting.invact import fit_invact

    from approxbp.cli import main

    calls = []
    real = F.rational
    monkeypatch.setattr(F, "rational", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    fit = fit_invact(BUMPED_SILU, progress=False)
    assert calls == [12], calls
    assert fit.table.form == "newton" and fit.fun <= 1e-6
    assert fit.table.provenance["method"].startswith("--form auto: no fast form")
    assert "falling back to --form newton" in capsys.readouterr().err
    assert main(["fit", "invact", "--activation", BUMPED_SILU, "--form", "fast", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "use form=" not in err and "the newton form serves it: approxbp fit invact --form newton" in err, err
    command = shlex.split(err.split("serves it: ")[1].strip())
    assert command[:4] == ["approxbp", "fit", "invact", "--form"]
    assert main([*command[1:], "--no-progress"]) == 0


def test_the_rational_fit_ends_at_a_least_squares_stationary_point():
    """One unweighted round fits eˣ by a degree-(2, 2) rational P/Q on the subsampled grid: Levenberg–Marquardt
    with the exact Jacobian of P/Q ends where the sum of squares has no slope (a wrong Jacobian stops short)."""
    from approxbp.fitting.invact_fast import EVERY, rational
    from numpy.polynomial import chebyshev as C

    z = np.linspace(-1, 1, 2001)
    _, P, Q = rational(z, np.exp(z), 2, rounds=1)
    zs = z[::EVERY]

    def squares(p):
        return np.sum((C.chebval(zs, p[:3]) / C.chebval(zs, np.concatenate([[1.0], p[3:]])) - np.exp(zs)) ** 2)

    p, h = np.concatenate([P, Q[1:]]), 1e-6
    slope = [(squares(p + h * e) - squares(p - h * e)) / (2 * h) for e in np.eye(5)]
    assert np.max(np.abs(slope)) < 1e-9 * len(zs), slope
