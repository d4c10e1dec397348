"""Exact inverted activations of piecewise increasing activations with any finite infimum (issue 47): ELU, SELU,
CELU and softplus − 1 derived piece by piece, proven by sympy per piece, served by one-branch kernels that save y
alone, swapped in for torch's modules and trained like them; every check against torch's own autograd or mpmath."""

import copy

import mpmath
import numpy as np
import pytest
import torch
from _helpers import sgd_steps
from approxbp.approximations import get_activation
from approxbp.approximations import table_schema as TS
from approxbp.approximations import tables as table_files
from approxbp.fitting.certify import certify_table
from approxbp.fitting.invact_exact import derive_monotone, infimum
from approxbp.kernels import InvActivation, patch_model
from torch import nn

TORCH = {"elu": nn.ELU(), "selu": nn.SELU(), "celu": nn.CELU()}


@pytest.mark.parametrize("name, inf, q", [("elu", -1.0, "select(y, 1, y + 1)"), ("celu", -1.0, "select(y, 1, y + 1)"),
                                          ("log(1+exp(x)) - 1", -1.0, "1 - exp(-1)*exp(-y)")])
def test_closed_forms_and_infima(name, inf, q):
    assert infimum(name) == inf and str(derive_monotone(name)) == q


@pytest.mark.parametrize("name", ["elu", "selu", "celu"])
def test_a_fit_now_reproduces_the_packaged_table(name):
    """`approxbp fit invact --activation elu` derives the packaged table again (its check evaluates ELU in mpmath
    through expm1, which once had no mpmath form)."""
    from approxbp.fitting.invact import fit_invact

    t, packaged = fit_invact(name, progress=False).table, table_files.load(f"invact/{name}-exact")
    assert t.right.expression == packaged.right.expression and t.f_T == packaged.f_T
    assert t.metrics["linf_right"] <= 1e-15


@pytest.mark.parametrize("name", ["elu", "selu", "celu"])
def test_the_packaged_table_is_f_prime_of_the_inverse_and_certified(name):
    """q(f(x)) = f′(x) at 40 points over 30 decades either side of the kink, to float64 rounding of the saved y
    (near inf f, y + 1 keeps y's absolute error: 1e-16, not a relative one), and the stored certificate is sympy's
    per-piece identity."""
    t = table_files.load(f"invact/{name}-exact")
    assert t.monotone and t.source == "derived" and t.f_T == pytest.approx(infimum(name), rel=1e-15)
    assert t.metrics["certified"]["right"]["identity"] is True
    entry, lines, ok = certify_table(t)
    assert ok and entry["right"]["identity"], lines
    act = get_activation(name)
    from approxbp.approximations.invact_forms import Form

    q = Form.from_table(t.right)
    xs = np.concatenate([-np.logspace(-30, 1.5, 20), np.logspace(-30, 1.5, 20)])
    with mpmath.workdps(50):
        want = np.array([float(act.mp(mpmath.mpf(v), 1, None)) for v in xs])
    assert np.allclose(q(act.f(xs)), want, rtol=4e-16, atol=4e-16)


@pytest.mark.parametrize("name", ["elu", "selu", "celu"])
@pytest.mark.parametrize("use_triton", [False, True])
def test_the_drop_in_saves_y_alone_and_its_gradient_is_torchs(name, use_triton):
    """Forward and gradient equal torch's module (float32, the Triton kernel under TRITON_INTERPRET=1 included), and
    only y is saved: no bit, since the activation increases."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(997) * 4, torch.tensor([0.0, -1e-30, 1e-30])]).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    mod = InvActivation(f"invact/{name}-exact", use_triton=use_triton)
    y, want = mod(x), TORCH[name](ref)
    y.backward(torch.ones_like(y))
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(y, want, rtol=2e-7, atol=2e-7)
    torch.testing.assert_close(x.grad, ref.grad, rtol=2e-7, atol=2e-7)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        mod(x)
    assert sum(t.numel() * t.element_size() for t in kept) <= x.numel() * 4 + 64


def test_patch_model_swaps_torchs_elu_family_and_trains_as_stock():
    """nn.ELU, nn.SELU and nn.CELU (torch's α) are swapped for their exact tables in either family, save less and
    train like stock; an ELU of another α is skipped, naming the fit of its own exact table (the next test runs it)."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 32), nn.ELU(), nn.Linear(32, 32), nn.SELU(), nn.Linear(32, 32), nn.CELU(),
                          nn.Linear(32, 16), nn.ELU(alpha=0.5), nn.Linear(16, 1)).double()
    for family in ("invact", "relu-sum"):
        model = copy.deepcopy(stock)
        x = torch.randn(16, 8, dtype=torch.float64)
        report = patch_model(model, family=family, example_input=x)
        assert all(isinstance(model[i], InvActivation) for i in (1, 3, 5)), report
        assert isinstance(model[7], nn.ELU) and any("alpha = 0.5" in s and "approxbp fit invact" in s
                                                    for s in report.skipped), report
        assert report.saved_bytes[1] < report.saved_bytes[0], report
        for a, b in zip(sgd_steps(copy.deepcopy(stock), x, steps=20).parameters(),
                        sgd_steps(model, x, steps=20).parameters()):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_users_piecewise_expression_goes_through_fit_certify_export_and_patch(tmp_path):
    """The way forward named for nn.ELU(alpha=0.5): the user's own Max/Min expression (accepted since its kinks are
    located exactly) is derived, proven, exported and swapped in; it trains like stock."""
    import shlex

    from approxbp.cli import main

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 32), nn.ELU(alpha=0.5), nn.Linear(32, 1)).double()
    reason = next(s for s in patch_model(copy.deepcopy(stock), family="invact").skipped if "alpha = 0.5" in s)
    command = shlex.split(reason.split("fit its exact one: ")[1].split(", then")[0])
    out = tmp_path / "elu.json"
    assert main([*[a if a != "elu.json" else str(out) for a in command[1:]], "--no-progress"]) == 0
    assert main(["certify", str(out), "--no-progress"]) == 0 and main(["export", str(out)]) == 0
    model, x = copy.deepcopy(stock), torch.randn(16, 8, dtype=torch.float64)
    report = patch_model(model, family=None, tables={"ELU": str(out)}, example_input=x)
    assert isinstance(model[1], InvActivation) and report.saved_bytes[1] < report.saved_bytes[0], report
    for a, b in zip(sgd_steps(copy.deepcopy(stock), x, steps=20).parameters(),
                    sgd_steps(model, x, steps=20).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


SATURATING = {"hardsigmoid": nn.Hardsigmoid(), "relu6": nn.ReLU6(), "hardtanh": nn.Hardtanh()}


@pytest.mark.parametrize("name, inf, q", [("hardsigmoid", 0.0, "select(y, select(1.0 - y, 1/6, 0), 0)"),
                                          ("relu6", 0.0, "select(y, select(6.0 - y, 1, 0), 0)"),
                                          ("hardtanh", -1.0, "select(y + 1.0, select(1.0 - y, 1, 0), 0)")])
def test_non_decreasing_activations_with_constant_pieces_get_q_zero_at_the_constants(name, inf, q):
    """ReLU6, hard-sigmoid, hard-tanh: no increasing piece takes a constant piece's value, so q(c) = 0 there and
    the slope between: the saved y alone gives f′ (torch's own backward saves the input)."""
    assert infimum(name) == inf and str(derive_monotone(name)) == q


def test_a_table_whose_q_is_not_zero_at_a_constant_piece_is_refused():
    t = table_files.load("invact/relu6-exact").to_json()
    t["right"] = dict(t["right"], expression="select(6 - y, 1, 0)", operations=2)  # q(0) = 1: gradient on x < 0
    with pytest.raises(TS.TableError, match="q = 0 at its constant pieces"):
        table_files.from_json(t, "relu6.json")


@pytest.mark.parametrize("name", list(SATURATING))
@pytest.mark.parametrize("use_triton", [False, True])
def test_saturating_drop_ins_give_torchs_gradient_kinks_included(name, use_triton):
    """Forward and gradient equal torch's (float32; the kinks themselves and the constant pieces included, where
    torch's gradient is 0), the Triton kernel under TRITON_INTERPRET=1 too; y alone is saved."""
    torch.manual_seed(0)
    kinks = {"hardsigmoid": (-3.0, 3.0), "relu6": (0.0, 6.0), "hardtanh": (-1.0, 1.0)}[name]
    x = torch.cat([torch.randn(997) * 5, torch.tensor(kinks)]).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    mod = InvActivation(f"invact/{name}-exact", use_triton=use_triton)
    y, want = mod(x), SATURATING[name](ref)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    torch.testing.assert_close(y, want, rtol=2e-7, atol=2e-7)
    away = (y.detach() - want.detach()).abs() == 0  # where y is exact, so is q(y): everywhere here
    torch.testing.assert_close(x.grad[away], ref.grad[away], rtol=2e-7, atol=2e-7)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        mod(x)
    assert sum(t.numel() * t.element_size() for t in kept) <= x.numel() * 4 + 64


def test_patch_model_swaps_relu6_hardsigmoid_and_hardtanh_and_saves_their_input():
    """MobileNet's pattern (Linear → ReLU6 → Linear): torch keeps ReLU6's input and the next Linear keeps its output;
    the exact table keeps only the output, which the Linear shares. Trains exactly as stock."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 16), nn.ReLU6(), nn.Linear(16, 16), nn.Hardsigmoid(), nn.Linear(16, 16),
                          nn.Hardtanh(), nn.Linear(16, 2))
    model = copy.deepcopy(stock)
    x = torch.randn(32, 8) * 3
    report = patch_model(model, family="relu-sum", example_input=x)
    assert [s.split(":")[0] for s in report.activations] == ["1", "3", "5"], report
    assert all("InvActivation(table=" in s for s in report.activations), report
    before, after = report.saved_bytes
    assert after <= before - 3 * 32 * 16 * 4 + 3 * 64, report.saved_bytes  # three inputs of 32 × 16 fp32 no longer kept
    sgd_steps(stock, x, 5)
    sgd_steps(model, x, 5)
    for (name, a), b in zip(stock.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_the_relu_sum_refusal_of_a_bounded_activation_names_the_exact_invact_fit_and_it_runs():
    """Eq. 13 cannot match hard-sigmoid (h − x does not tend to 0); the refusal's first way forward is the exact
    InvAct fit, which succeeds, exact."""
    import re

    from approxbp.fitting.invact import fit_invact

    with pytest.raises(ValueError) as refused:
        get_activation("hardsigmoid").check_relu_sum_asymptotics(2)
    named = re.search(r"approxbp fit invact --activation '(\w+)'", str(refused.value))
    assert named and "--levels free" in str(refused.value)
    t = fit_invact(named.group(1), progress=False).table
    assert t.form == "exact" and t.monotone and t.metrics["linf_right"] == 0


@pytest.mark.parametrize("expression", ["exp(x) + exp(5*x)", "exp(x) + exp(sqrt(2)*x)"])
def test_an_increasing_activation_without_a_closed_form_inverse_is_refused_with_a_way_forward(expression):
    """sympy finds no inverse (a quintic in eˣ; no algorithm at all for the irrational power): one line naming the
    free-level fit, never sympy's own exception."""
    with pytest.raises(ValueError, match=r"not one\. A way forward: approxbp fit relu-sum --levels free"):
        derive_monotone(expression)
