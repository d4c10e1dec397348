"""Exact inverted-activation tables: ReLU² (Nemotron, Primer) saves only its output y and
backpropagates with f′(f⁻¹(y)) = 2√y, exactly; every other activation is refused with the reason."""

import copy

import pytest
import torch
from _helpers import sgd_steps
from approxbp.approximations import tables as table_files
from approxbp.fitting.invact import fit_invact
from approxbp.fitting.invact_exact import derive_exact, exact_table
from approxbp.kernels import InvActivation, patch_model
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

PACKAGED = table_files.data_dir() / "invact" / "relu2-exact.json"


def test_the_packaged_table_is_what_the_derivation_gives():
    packaged = table_files.load(PACKAGED)
    assert table_files.definition_sha256(exact_table("relu2")) == table_files.definition_sha256(packaged)
    right, q = derive_exact("relu2")
    assert str(q) == "2*sqrt(y)" and str(right) == "x**2"


@pytest.mark.parametrize("activation, why", [("silu", "constant for x < 0"), ("gelu", "constant for x < 0")])
def test_activations_without_a_closed_form_are_refused(activation, why):
    with pytest.raises(ValueError, match=why):
        exact_table(activation)


def test_the_fits_refuse_relu2_and_point_to_the_exact_form():
    with pytest.raises(ValueError, match="--form exact"):
        fit_invact("relu2", "fast", progress=False)


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=70),
       use_triton=st.booleans())
def test_gradient_equals_autograd_of_relu_squared_in_float64(values, use_triton):
    """The independent reference: torch's own autograd through relu(x)**2, in float64 (2√(x²) = 2x to rounding)."""
    x = torch.tensor(values, dtype=torch.float64)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = InvActivation("invact/relu2-exact", use_triton=use_triton)(ours)
    want = torch.relu(ref) ** 2
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    g = torch.linspace(-1, 1, x.numel(), dtype=torch.float64)
    y.backward(g)
    want.backward(g)
    # where x² underflows (|x| < √(smallest subnormal) ≈ 1.5e-162) y = 0 and the gradient is 0 in place of 2x·g
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-15, atol=2 * 1.6e-162)


class ReLUSquaredActivation(nn.Module):  # Hugging Face's class name (Nemotron's MLP)
    def forward(self, x):
        return torch.relu(x) ** 2


class SquaredMLP(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, 4 * d), ReLUSquaredActivation(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("activation", ["relu-sum", "invact"])
def test_patch_model_swaps_relu_squared_for_the_exact_table_and_trains_as_stock(activation):
    torch.manual_seed(0)
    stock = SquaredMLP().double()
    model = copy.deepcopy(stock)
    x = torch.randn(4, 8, dtype=torch.float64)
    report = patch_model(model, family=activation, example_input=x)
    assert isinstance(model.act, InvActivation) and model.act.spec.table["form"] == "exact", report
    assert report.saved_bytes[1] < report.saved_bytes[0]  # relu's output r is no longer kept beside y = r²
    for a, b in zip(sgd_steps(stock, x).parameters(), sgd_steps(model, x).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
