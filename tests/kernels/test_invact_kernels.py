"""Generated InvAct kernels (every invact table) under TRITON_INTERPRET=1 against the pure-PyTorch twin."""

import math

import numpy as np
import pytest
import torch
from _accuracy import tolerance_ok
from _helpers import exported
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.kernels import InvActGELU, InvActivation, saved_bytes
from approxbp.kernels.ops.invact import InvActSpec
from hypothesis import given, settings
from hypothesis import strategies as st

TABLES = table_files.table_paths("invact")
IDS = [p.stem for p in TABLES]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: both tl.where branches evaluated


@pytest.mark.parametrize("path", TABLES, ids=IDS)
def test_kernel_matches_twin_and_truth(path):
    spec = InvActSpec(str(path))
    x = torch.cat([torch.linspace(-12, 12, 8191), torch.tensor([spec.turning_point or 0.0, 0.0, -0.0])]).float()
    y1, b1 = spec.forward_triton(x)
    y0, b0 = spec.forward_torch(x)
    bits = 0 if spec.monotone else math.ceil(x.numel() / 8)  # a monotone table saves no branch bit
    assert torch.equal(b1, b0) and b1.numel() == bits
    truth = torch.tensor(np.asarray(get_activation(spec.table["expression"]).f(x.double().numpy())))
    assert tolerance_ok(y1, y0, truth, x, spec.table["activation"], ulps=8)  # as good as torch in fp32
    g = torch.randn_like(x)
    d64 = spec.backward_torch(g.double(), *spec.forward_torch(x.double()))
    e_kernel = (spec.backward_triton(g, y1, b1).double() - d64).abs().max()
    e_twin = (spec.backward_torch(g, y0, b0).double() - d64).abs().max()
    # fp32 evaluation of the same fitted expression: near the turning point y's rounding dominates (README)
    assert e_kernel <= 3 * e_twin + 1e-4 * g.abs().max()


@pytest.mark.parametrize("path", [p for p in TABLES if p.stem in ("gelu-newton", "silu-newton", "mish-newton")])
def test_float64_kernel_evaluates_the_form_in_float64(path):
    spec = InvActSpec(str(path))
    x = torch.linspace(-10, 10, 4001, dtype=torch.float64)
    y1, b1 = spec.forward_triton(x)
    y0, b0 = spec.forward_torch(x)
    assert y1.dtype == torch.float64 and torch.allclose(y1, y0, rtol=1e-14, atol=1e-15)
    g = torch.randn_like(x)
    assert torch.allclose(spec.backward_triton(g, y1, b1), spec.backward_torch(g, y0, b0), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 2049])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_module_triton_path_equals_twin_in_every_dtype(n, dtype, seed=0):
    x = (3 * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(dtype)
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    xi = x.clone().requires_grad_(True)
    module = InvActGELU(use_triton=True)
    y1 = module(xi)
    y1.backward(g)
    y1, d1 = y1.detach(), xi.grad
    # the kernels' oracle: the generated twin in fp32 rounded once (the CPU path's y is torch's own F.gelu, to which
    # test_opinfo holds it bit for bit), and the twin's backward rule on the kernel's own saved y
    spec = module.spec
    y0 = spec.module.activation_twin(x.float()).to(dtype)
    d0 = spec.backward_torch(g, y1, spec.forward_torch(x)[1])
    assert y1.dtype == dtype and d1.dtype == dtype and y1.shape == (n,)
    eps = torch.finfo(dtype).eps  # the interpreter truncates fp32 → bf16 (README): allow 2 ulp
    assert torch.allclose(y1.float(), y0.float(), rtol=2 * eps, atol=2 * eps)
    # the backward reads y in this dtype: near the turning point q(y) is limited to ≈ √(2a₂·ulp(f(T)))
    limit = {torch.float32: 4e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    atol = limit * (1 + float(g.float().abs().max())) if n else 0.0
    assert torch.allclose(d1.float(), d0.float(), rtol=4 * eps, atol=atol)


def test_triton_path_shares_output_storage_and_saves_one_bit():
    m = InvActGELU(use_triton=True)
    x = torch.randn(33, 17, requires_grad=True)
    y = m(x)
    assert y.grad_fn.saved_tensors[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert saved_bytes(lambda: m(x)) == 33 * 17 * 4 + math.ceil(33 * 17 / 8)


def test_nan_propagates_through_the_kernel():
    m = InvActivation("silu-newton", use_triton=True)
    x = torch.tensor([1.0, float("nan"), -2.0], requires_grad=True)
    y = m(x)
    assert torch.isnan(y[1])
    y.backward(torch.tensor([float("nan"), 1.0, 1.0]))
    assert torch.isnan(x.grad[0]) and torch.isnan(x.grad[1]) and torch.isfinite(x.grad[2])


def test_non_contiguous_input():
    base = torch.randn(12, 9)
    outs = []
    for use_triton in (True, False):
        xb = base.clone().requires_grad_(True)
        InvActGELU(use_triton=use_triton)(xb.t()).pow(2).sum().backward()
        outs.append(xb.grad)
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@settings(max_examples=25)
@given(values=st.lists(st.floats(-30, 30, width=32), min_size=0, max_size=300),
       table=st.sampled_from(["gelu-newton", "silu-newton", "mish-newton"]))
def test_kernel_on_arbitrary_values_property(values, table):
    """Hypothesis: any fp32 values give the twin's branch bits and a backward within the fp32 limit."""
    spec = InvActSpec(table)
    x = torch.tensor(values, dtype=torch.float32)
    y1, b1 = spec.forward_triton(x)
    y0, b0 = spec.forward_torch(x)
    assert torch.equal(b1, b0)
    truth = torch.tensor(np.asarray(get_activation(spec.table["expression"]).f(x.double().numpy())))
    assert tolerance_ok(y1, y0, truth, x, spec.table["activation"], ulps=8)
    g = torch.ones_like(x)
    d1, d0 = spec.backward_triton(g, y1, b1), spec.backward_torch(g, y0, b0)
    assert torch.allclose(d1, d0, rtol=1e-5, atol=4e-3)


def test_new_activation_gets_a_working_kernel_without_hand_written_code(tmp_path):
    """fit → table → generated module (next to the table) → Triton path, for an activation not in the registry."""
    from approxbp.fitting.invact import fit_invact

    path = exported(fit_invact("x*sigmoid(1.5*x)", "newton").table, tmp_path / "invact" / "mine-newton.json")
    m = InvActivation(str(path), use_triton=True)
    x = torch.linspace(-6, 6, 1001, requires_grad=True)
    m(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (x2 * torch.sigmoid(1.5 * x2)).sum().backward()
    assert (tmp_path / "invact" / "_generated").is_dir()
    assert torch.max(torch.abs(x.grad - x2.grad)) < 2e-3  # fp32 limit near the turning point (README)
