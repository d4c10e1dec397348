"""Monotone inverted activations: an increasing activation (softplus, squareplus) has one branch, so the saved output
alone gives f′(f⁻¹(y)) — no branch bit. The table is derived in closed form, proven by sympy, run by generated kernels
that save y alone, and swapped in for nn.Softplus; every check is against mpmath or torch's own autograd."""

import copy
import json

import mpmath
import pytest
import torch
from _helpers import sgd_steps
from approxbp.approximations import get_activation
from approxbp.approximations import table_schema as TS
from approxbp.approximations import tables as table_files
from approxbp.fitting.certify import certify_table, identity_proof
from approxbp.fitting.invact import fit_invact
from approxbp.fitting.invact_exact import derive_monotone, takes_exact
from approxbp.kernels import InvActivation, patch_model
from approxbp.kernels.codegen import export
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

SQUAREPLUS = "(x + sqrt(x**2 + 4))/2"
PACKAGED = table_files.data_dir() / "invact" / "softplus-exact.json"


@pytest.fixture(scope="module")
def squareplus(tmp_path_factory):
    """A user's monotone activation, fitted (derived) and exported as the CLI would."""
    path = tmp_path_factory.mktemp("squareplus") / "squareplus.json"
    table_files.save(fit_invact(SQUAREPLUS, progress=False).table, path)
    export([path])
    return path


@pytest.mark.parametrize("activation", ["softplus", SQUAREPLUS])
def test_the_derived_q_is_f_prime_of_the_inverse_at_50_digits(activation):
    """q(f(x)) = f′(x), with f and f′ from mpmath's own differentiation of the expression, at x over 40 decades."""
    act = get_activation(activation)
    q = derive_monotone(activation)
    import sympy as sp

    q_mp = sp.lambdify(sp.Symbol("y"), q, "mpmath")
    f = sp.lambdify(sp.Symbol("x"), act.expr.subs(sp.Symbol("x", real=True), sp.Symbol("x")), "mpmath")
    with mpmath.workdps(50):
        for x in (-1e3, -30, -1, -1e-8, 0, 1e-8, 0.5, 3, 40, 1e4):
            want = mpmath.diff(lambda v: act.mp(v, 0, None), mpmath.mpf(x))
            got = q_mp(act.mp(mpmath.mpf(x), 0, None))
            assert abs(got - want) <= mpmath.mpf(10) ** -40 * (1 + abs(want)), (x, got, want, f)


def test_closed_forms():
    assert str(derive_monotone("softplus")) == "1 - exp(-y)"
    assert str(derive_monotone(SQUAREPLUS)) == "y**2/(y**2 + 1)"


def test_auto_picks_the_exact_one_branch_table_for_increasing_activations_only():
    assert takes_exact("softplus") and takes_exact(SQUAREPLUS) and takes_exact("relu2")
    assert not takes_exact("gelu") and not takes_exact("x*tanh(exp(x))")
    t = fit_invact("softplus", progress=False).table
    assert t.monotone and t.branches == ("right",) and t.turning_point is None and t.left is None
    packaged = table_files.load(PACKAGED).to_json() | {"metrics": t.metrics}
    assert table_files.definition_sha256(t) == table_files.definition_sha256(packaged)
    with pytest.raises(ValueError, match="not increasing"):
        derive_monotone("gelu")


def test_a_table_that_breaks_the_monotone_rules_is_refused():
    good = json.loads(PACKAGED.read_text())
    for change, field in (({"turning_point": 0.0}, "turning_point"), ({"f_T": 0.5}, "f_T"),
                          ({"expression": "x*sigmoid(x)", "activation": "my-silu"}, "monotone"),
                          ({"monotone": 1}, "monotone")):
        with pytest.raises(TS.TableError, match=field):
            table_files.from_json({**good, **change})
    bad = copy.deepcopy(good)
    bad["metrics"]["certified"]["right"]["bound"] = 1e-3
    with pytest.raises(TS.TableError, match="identity"):
        table_files.from_json(bad)


def test_sympy_proves_the_identity_and_rejects_a_wrong_q(squareplus):
    t = table_files.load(squareplus)
    assert identity_proof(t, "right")
    wrong = t.to_json()
    wrong["right"]["expression"] = "y**2/(y**2 + 1.001)"
    assert not identity_proof(table_files.from_json(wrong), "right")
    entry, lines, ok = certify_table(t, max_boxes=2000)
    assert ok and entry["right"]["identity"] and entry["right"]["float32_evaluation"] < 1e-6, lines


@pytest.mark.parametrize("use_triton", [False, True])
def test_the_drop_in_saves_y_alone_and_its_gradient_is_autograds(squareplus, use_triton):
    # the CPU path's forward is torch's softplus (its threshold: x beyond 20), the kernel's log1p(exp(x))
    softplus = (lambda v: torch.log1p(torch.exp(v))) if use_triton else torch.nn.functional.softplus
    for table, reference in ((PACKAGED, softplus),
                             (squareplus, lambda v: (v + torch.sqrt(v * v + 4)) / 2)):
        x = torch.linspace(-40, 40, 3001, dtype=torch.float64)
        ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, sizes=sizes: sizes.append(t.nbytes) or t,
                                                      lambda t: t):
            y = InvActivation(table, use_triton=use_triton)(ours)
        want = reference(ref)
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-15)  # the Triton softplus: log1p to 1e-13
        assert sizes == [x.nbytes, 0]  # y, and an empty tensor where the branch bits would be
        g = torch.linspace(-1, 1, x.numel(), dtype=torch.float64)
        y.backward(g)
        want.backward(g)
        if table is PACKAGED and not use_triton:  # torch's softplus backward is 1 beyond its threshold: the derivative
            ref.grad = g * torch.sigmoid(x)      # σ(x) is what the table's exact rule returns
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-12, atol=1e-15)


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=40))
def test_float32_gradient_within_the_certified_evaluation_bound(values):
    x = torch.tensor(values, dtype=torch.float32)
    ours = x.clone().requires_grad_()
    InvActivation(PACKAGED)(ours).sum().backward()
    want = torch.sigmoid(x.double())  # softplus′, the exact gradient
    bound = table_files.load(PACKAGED).metrics["certified"]["right"]["float32_evaluation"]
    # y is rounded to float32 before q reads it: |Δq| ≤ max q′ · |Δy| = e^(−y)·|Δy| ≤ 2⁻²⁴ (|Δy| ≤ 2⁻²⁴·y ≤ e^y·2⁻²⁴);
    # the product with the incoming 1 rounds once more
    assert float((ours.grad.double() - want).abs().max()) <= bound + 2**-24 + 2**-24


def test_patch_model_swaps_nn_softplus_and_trains_as_stock():
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(8, 32), nn.Softplus(), nn.Linear(32, 8), nn.Softplus(beta=2),
                          nn.Linear(8, 1)).double()
    model = copy.deepcopy(stock)
    x = torch.randn(16, 8, dtype=torch.float64)
    report = patch_model(model, family="invact", example_input=x)
    assert isinstance(model[1], InvActivation) and model[1].spec.monotone, report
    assert isinstance(model[3], nn.Softplus) and any("beta = 2" in s for s in report.skipped), report
    assert report.saved_bytes[1] < report.saved_bytes[0], report
    for a, b in zip(sgd_steps(stock, x).parameters(), sgd_steps(model, x).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


LEAKY = {"leaky square": ("select(x, x**2, 0.05*x)", "select(y, 2*sqrt(y), 1/20)",
                          lambda v: torch.where(v > 0, v * v, 0.05 * v)),
         "leaky ReLU": ("select(x, x, 0.1*x)", "select(y, 1, 1/10)", lambda v: torch.where(v > 0, v, 0.1 * v))}


@pytest.mark.parametrize("name", sorted(LEAKY))
def test_an_activation_unbounded_below_gets_the_one_branch_exact_form(name, tmp_path):
    """h → −∞ as x → −∞ (leaky pieces) once met 'needs a finite infimum' from `fit invact`, though f increases and
    f′∘f⁻¹ has a closed form on each piece: the table is one branch with no bit and no floor (f_T = −float32 max,
    a clamp that changes no finite y), proven by sympy, and the drop-in's gradient is autograd's for |x| ≤ 1e4."""
    from approxbp.approximations.table_checks import UNBOUNDED_BELOW

    expression, q, reference = LEAKY[name]
    table = fit_invact(expression, progress=False).table
    assert table.monotone and table.form == "exact" and table.f_T == UNBOUNDED_BELOW
    assert table.right.expression == q and table.metrics["linf_right"] == 0.0
    entry, _, held = certify_table(table, budget_s=60)
    assert held and entry["right"]["identity"]
    path = table_files.save(table, tmp_path / "leaky.json")
    table_files.load(path)  # validated on read
    export([path])
    for use_triton in (False, True):
        x = torch.cat([-torch.logspace(4, -6, 400), torch.zeros(1), torch.logspace(-6, 4, 400)]).double()
        ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = InvActivation(path, use_triton=use_triton)(ours)
        want = reference(ref)
        torch.testing.assert_close(y, want, rtol=1e-15, atol=0)
        g = torch.linspace(-1, 1, x.numel(), dtype=torch.float64)
        y.backward(g)
        want.backward(g)
        # the kernels write the form's numbers as float32 literals (1/10 to 2^-24 relative)
        torch.testing.assert_close(ours.grad, ref.grad, rtol=2.0**-23 if use_triton else 1e-12, atol=1e-300)


def test_a_table_claiming_no_floor_for_a_bounded_activation_is_refused():
    from approxbp.approximations.table_checks import UNBOUNDED_BELOW

    d = json.loads(PACKAGED.read_text())
    d["f_T"] = d["right"]["domain"][0] = UNBOUNDED_BELOW
    with pytest.raises(ValueError, match="f_T"):
        table_files.from_json(d)
