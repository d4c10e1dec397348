"""InvAct drop-ins: exact forward, output-sharing saved memory, backward ≈ exact f'(x)."""

import pytest
import torch
from _helpers import exact_grad as _exact_grad
from approxbp.kernels import (
    InvActGELU,
    InvActivation,
    InvActSiLU,
    MSLayerNorm,
    MSRMSNorm,
    ReGELU2,
    ReSiLU2,
    saved_bytes,
)
from torch import nn


@pytest.mark.parametrize("module,ref", [(InvActGELU, nn.GELU()), (InvActSiLU, nn.SiLU())])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.float32, 2e-3)])  # x-space L∞: docs atlas
def test_forward_exact_and_backward_close(module, ref, dtype, tol):
    m = module()
    x = torch.cat([torch.linspace(-8, 8, 2001), torch.tensor([0.0, m.spec.turning_point])]).to(dtype)
    x.requires_grad_(True)
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


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----



DROP_INS = [lambda u: ReGELU2(use_triton=u), lambda u: ReSiLU2(use_triton=u), lambda u: InvActGELU(use_triton=u),
            lambda u: InvActSiLU(use_triton=u), lambda u: MSLayerNorm(4, use_triton=u),
            lambda u: MSRMSNorm(4, use_triton=u)]


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("cls,act", [(InvActGELU, "gelu"), (InvActSiLU, "silu")])
def test_invact_gradient_is_right_for_every_finite_input(cls, act, use_triton):
    big = torch.finfo(torch.float32).max
    x = torch.tensor([1e4, -1e4, 55.3, 315.2, 400.0, 1e6, 5e15, 1e30, big, -big, 1e-40, -1e-40, 1e-45, 0.0, 3.0, -3.0])
    x.requires_grad_(True)
    cls(use_triton=use_triton)(x).sum().backward()
    assert torch.isfinite(x.grad).all(), x.grad
    exact = _exact_grad(x.clamp(-1e4, 1e4), act).float()
    assert torch.allclose(x.grad, exact, atol=1e-5, rtol=0), (x.grad - exact).abs().max()  # fp32: see README


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("make", DROP_INS, ids=["ReGELU2", "ReSiLU2", "InvActGELU", "InvActSiLU", "MSLN", "MSRMS"])
def test_nan_in_gives_nan_gradient_and_integers_are_refused(make, use_triton):
    m = make(use_triton)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    x.requires_grad_(True)
    m(x).sum().backward()
    assert torch.isnan(x.grad[1, 2])
    for bad in (torch.arange(12).view(3, 4), torch.ones(3, 4, dtype=torch.bool)):
        with pytest.raises(TypeError, match="floating-point"):
            m(bad)
