"""InvAct drop-ins: exact forward, output-sharing saved memory, backward ≈ exact f'(x)."""

import pytest
import torch
from approxbp.kernels import InvActGELU, InvActivation, InvActSiLU, saved_bytes
from torch import nn


@pytest.mark.parametrize("module,ref", [(InvActGELU, nn.GELU()), (InvActSiLU, nn.SiLU())])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.float32, 2e-3)])  # x-space L∞: docs atlas
def test_forward_exact_and_backward_close(module, ref, dtype, tol):
    m = module()
    x = torch.cat([torch.linspace(-8, 8, 2001), torch.tensor([0.0, m.spec.T])]).to(dtype).requires_grad_(True)
    y = m(x)
    eps = torch.finfo(dtype).eps  # x·Φ(x) by ndtr vs torch's erf kernel: a few ulp apart in fp32
    assert torch.allclose(y, ref(x), rtol=8 * eps, atol=8 * eps)
    g = torch.randn_like(x)
    (dx,) = torch.autograd.grad(y, x, g)
    x2 = x.detach().clone().requires_grad_(True)
    (dref,) = torch.autograd.grad(ref(x2), x2, g)
    # fp64: the fitted form's error; fp32: y is rounded to fp32 first, which near the turning point limits
    # g to about √(2a₂·ulp(f(T))) (an inherent limit of saving y instead of x)
    assert torch.max(torch.abs(dx - dref)) <= tol * torch.max(torch.abs(g))


def test_saves_its_output_and_one_bit_per_element():
    m = InvActSiLU()
    x = torch.randn(64, 128, requires_grad=True)
    lin = nn.Linear(128, 16)
    lin.weight.requires_grad_(True)
    # activation alone: the output (4 B/elem in fp32) + 1 bit; followed by a Linear: no second copy
    assert saved_bytes(lambda: m(x)) == 64 * 128 * 4 + 64 * 128 // 8
    plain = nn.SiLU()
    params = list(lin.parameters())
    ours = saved_bytes(lambda: lin(m(x)), exclude=params)
    base = saved_bytes(lambda: lin(plain(x)), exclude=params)
    assert ours == 64 * 128 * 4 + 64 * 128 // 8 and base == 2 * 64 * 128 * 4


def test_output_storage_is_what_backward_uses():
    m = InvActGELU()
    x = torch.randn(10, requires_grad=True)
    y = m(x)
    saved = y.grad_fn.saved_tensors[0]
    assert saved.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_relu_sum_table_is_refused():
    with pytest.raises(Exception, match="invact"):
        InvActivation("relu_sum/gelu-k2-primitive")
