"""torch's own ops for the registry activations (``kernels/ops/stock.py``): what every drop-in's CPU forward returns.
Each is keyed by its registry name (issue 70: once by sympy's printout, SELU's a 30-digit string), and each computes
its activation: in float64 against the registry's own expression."""

import pytest
import torch
from approxbp.approximations import get_activation
from approxbp.kernels.ops.stock import STOCK_OPS, stock_op


@pytest.mark.parametrize("name", sorted(STOCK_OPS))
def test_each_stock_op_computes_its_registry_activation(name):
    x = torch.linspace(-9, 9, 4001, dtype=torch.float64)
    want = torch.from_numpy(get_activation(name).f(x.numpy()))
    torch.testing.assert_close(stock_op(name)(x), want, rtol=1e-12, atol=1e-12)


def test_a_generated_module_names_the_op_of_its_expression():
    """The build side sets ``STOCK`` from the expression (an ELU table and a CELU one of α = 1 are the same function:
    both F.elu); an expression torch has no op for gets None, and its drop-in runs the generated twin."""
    from approxbp.kernels.codegen.twins import stock_name
    from approxbp.kernels.generated import invact_celu_exact, relu_sum_gelu_k2_primitive

    assert relu_sum_gelu_k2_primitive.STOCK == "gelu" and invact_celu_exact.STOCK == "elu"
    assert stock_name(get_activation("selu").expression) == "selu" and stock_op(None) is None
    assert stock_name(get_activation("x*erf(log(1+exp(x)))").expression) is None
