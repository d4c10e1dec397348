"""The fitted one-branch InvAct form (issue 47): an increasing activation whose inverse sympy cannot write — the
Gaussian-smoothed ReLU E[ReLU(x + Z)] = x·Φ(x) + φ(x), whose h′ is Φ — gets a table from a fitted guess and Newton
steps, checked against scipy's root finder and Φ, certified, exported, run by its Triton kernel, patched and
trained; where the tail rule cannot hold it is refused with the free-level fit."""

import copy

import numpy as np
import pytest
import torch
from _helpers import sgd_steps
from approxbp.approximations import tables as table_files
from approxbp.fitting.certify import certify_table
from approxbp.fitting.invact import fit_invact
from approxbp.fitting.invact_exact import NoClosedForm
from approxbp.fitting.invact_fast import TOL
from approxbp.kernels import InvActivation, patch_model
from approxbp.kernels.codegen import export
from scipy.optimize import brentq
from scipy.special import ndtr
from torch import nn

SMOOTH_RELU = "x*(1+erf(x/sqrt(2)))/2 + exp(-x**2/2)/sqrt(2*pi)"


def smooth_relu(x):
    return x * ndtr(x) + np.exp(-x * x / 2) / np.sqrt(2 * np.pi)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Fitted by ``form="auto"`` (no closed form: the fitted one-branch form), saved and exported as the CLI would."""
    path = tmp_path_factory.mktemp("smoothrelu") / "smoothrelu.json"
    table_files.save(fit_invact(SMOOTH_RELU, progress=False).table, path)
    export([path])
    return path


def test_auto_fits_the_one_branch_newton_form_within_the_tolerance(table):
    t = table_files.load(table)
    assert (t.form, t.source, t.monotone, t.branches, t.f_T) == ("newton", "fit", True, ("right",), 0.0)
    assert t.metrics["linf_right"] <= TOL and t.right.domain[1] in (16.0, 64.0, 256.0, 1024.0)


def test_q_is_phi_of_the_inverse_found_by_scipy(table):
    """q(y) = Φ(f⁻¹(y)), f⁻¹ by brentq in float64 on f written with scipy's Φ (not the package's expression), for y
    over 20 decades and beyond the window (the tail rule q = h′(y)), through the torch twin in float64."""
    ys = np.concatenate([np.geomspace(1e-9, 1e3, 120), [5000.0, 1e5]])
    xs = np.array([brentq(lambda v, yv=yv: smooth_relu(v) - yv, -40.0, yv + 10.0, xtol=1e-300, rtol=1e-15)
                   for yv in ys])
    q = InvActivation(table).spec.q(torch.tensor(ys), torch.zeros(len(ys), dtype=torch.bool))
    assert float(np.max(np.abs(q.numpy() - ndtr(xs)))) <= TOL


def test_exact_refuses_it_naming_the_fitted_form_and_that_command_runs():
    with pytest.raises(NoClosedForm, match=r"A way forward: approxbp fit invact --form newton") as refused:
        fit_invact(SMOOTH_RELU, form="exact", progress=False)
    assert "--levels free" not in str(refused.value) or "relu-sum" in str(refused.value)
    assert fit_invact(SMOOTH_RELU, form="newton", progress=False).fun <= TOL


@pytest.mark.parametrize("expression", ["exp(x) + exp(5*x)", "exp(x) + exp(sqrt(2)*x)"])
def test_a_growing_tail_is_refused_by_the_fitted_form_with_free_levels(expression):
    """f grows like e^(5x): beyond any window h′(y) is not f′(f⁻¹(y)), so neither refusal names the fitted form."""
    with pytest.raises(ValueError, match=r"A way forward: approxbp fit relu-sum --levels free") as exact:
        fit_invact(expression, form="exact", progress=False)
    assert "--form newton" not in str(exact.value)
    refusal = r"beyond the fitted window.*h′ overflows\. A way forward: approxbp fit relu-sum --levels free"
    with pytest.raises(ValueError, match=refusal):
        fit_invact(expression, form="newton", progress=False)


@pytest.mark.slow
def test_the_certificate_holds_over_every_x(table):
    entry, lines, ok = certify_table(table_files.load(table), max_boxes=100_000)
    assert ok and entry["right"]["bound"] <= TOL, lines


@pytest.mark.parametrize("use_triton", [False, True])
def test_the_drop_in_saves_y_alone_and_its_float32_gradient_is_phi(table, use_triton):
    """The generated kernel (TRITON_INTERPRET=1 on CPU) and the torch path: y saved, no bit; dx = dy·Φ(x) in float32
    within the fit's tolerance plus float32 rounding of the Newton steps."""
    x = torch.linspace(-12, 40, 4099, dtype=torch.float32).requires_grad_()
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.nbytes) or t, lambda t: t):
        y = InvActivation(table, use_triton=use_triton)(x)
    assert sizes == [x.nbytes, 0]
    torch.testing.assert_close(y.double(), torch.tensor(smooth_relu(x.detach().double().numpy())), rtol=2e-6,
                               atol=1e-7)
    y.backward(torch.ones_like(y))
    err = (x.grad.double() - torch.special.ndtr(x.detach().double())).abs().max()
    assert float(err) <= 2e-6


def test_patch_model_with_the_table_trains_as_stock(table):
    class SmoothReLU(nn.Module):
        def forward(self, x):
            return x * torch.special.ndtr(x) + torch.exp(-x * x / 2) / (2 * torch.pi) ** 0.5

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 32), SmoothReLU(), nn.Linear(32, 1)).double()
    model = copy.deepcopy(stock)
    x = torch.randn(16, 8, dtype=torch.float64)
    report = patch_model(model, family=None, tables={"SmoothReLU": str(table)}, example_input=x)
    assert isinstance(model[1], InvActivation) and report.saved_bytes[1] < report.saved_bytes[0], report
    for a, b in zip(sgd_steps(stock, x).parameters(), sgd_steps(model, x).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
