"""Memory-sharing norms (Approx-BP App. G): exact merge, exact gradients, measured sharing."""

import math

import pytest
import torch
from approxbp.kernels import (
    MSLayerNorm,
    MSRMSNorm,
    merge_norm,
    saved_bytes,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn


def _block(norm_cls, d=16, seed=0):
    torch.manual_seed(seed)
    norm = norm_cls(d, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if getattr(norm, "bias", None) is not None:
            norm.bias.uniform_(-0.5, 0.5)
    q, k, v = (nn.Linear(d, 8).double() for _ in range(3))
    return norm, [q, k, v]


@pytest.mark.parametrize("norm_cls", [nn.LayerNorm, nn.RMSNorm])
def test_merge_preserves_the_function_for_every_consumer(norm_cls):
    norm, lins = _block(norm_cls)
    x = torch.randn(5, 7, 16, dtype=torch.float64)
    before = [lin(norm(x)) for lin in lins]
    ms = merge_norm(norm, lins)
    after = [lin(ms(x)) for lin in lins]
    for a, b in zip(before, after):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls,ref", [(MSLayerNorm, lambda x: nn.functional.layer_norm(x, (12,), eps=1e-6)),
                                     (MSRMSNorm, lambda x: nn.functional.rms_norm(x, (12,), eps=1e-6))])
def test_gradients_equal_autograd_of_the_plain_norm(cls, ref):
    x = torch.randn(4, 3, 12, dtype=torch.float64, requires_grad=True)
    m = cls(12, eps=1e-6)
    assert torch.autograd.gradcheck(m, (x,))
    g = torch.randn(4, 3, 12, dtype=torch.float64)
    (dx,) = torch.autograd.grad(m(x), x, g)
    (dref,) = torch.autograd.grad(ref(x), x, g)
    assert torch.allclose(dx, dref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm_cls", [nn.LayerNorm, nn.RMSNorm])
def test_norm_and_consumers_share_one_tensor(norm_cls):
    d, rows = 64, 32
    norm, lins = _block(norm_cls, d)
    for m in (norm, *lins):
        m.float()
    params = [p for m in (norm, *lins) for p in m.parameters()]
    x = torch.randn(rows, d, requires_grad=True)
    def run(n):
        z = n(x)  # one norm, three consumers (q, k, v)
        return [lin(z) for lin in lins]

    plain = saved_bytes(lambda: run(norm), exclude=params)
    ms = merge_norm(norm, lins)
    params = [p for m in lins for p in m.parameters()]
    shared = saved_bytes(lambda: run(ms), exclude=params)
    # MS: one fp32 z (rows·d·4 bytes) shared by the norm and all three Linears, plus one fp32 σ⁻¹ per row
    assert shared == rows * d * 4 + rows * 4
    assert plain > shared


def test_bad_input():
    with pytest.raises(ValueError, match="last dimension 8"):
        MSLayerNorm(8)(torch.randn(2, 9))
    with pytest.raises(ValueError, match="at least one consumer"):
        merge_norm(nn.LayerNorm(4), [])
    with pytest.raises(ValueError, match="in_features=4"):
        merge_norm(nn.LayerNorm(4), [nn.Linear(5, 2)])


@pytest.mark.parametrize("cls", [MSLayerNorm, MSRMSNorm])
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 96), (1, 1000), (0, 16), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_triton_norm_kernels_match_the_twin(cls, shape, dtype):
    """The fused row kernels (TRITON_INTERPRET=1) against the PyTorch twin: forward, backward, saved σ⁻¹."""
    g = torch.Generator().manual_seed(sum(shape))
    x0 = (3 * torch.randn(shape, generator=g, dtype=torch.float64) + 1).to(dtype)
    dz = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    outs = []
    for use_triton in (True, False):
        x = x0.clone().requires_grad_(True)
        z = cls(shape[-1], use_triton=use_triton)(x)
        rstd = z.grad_fn.saved_tensors[1]
        z.backward(dz)
        outs.append((z.detach(), x.grad, rstd))
    (z1, d1, r1), (z0, d0, r0) = outs
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    assert z1.dtype == dtype and d1.dtype == dtype and r1.dtype == r0.dtype and r1.shape == r0.shape
    assert torch.allclose(z1.double(), z0.double(), rtol=tol, atol=tol)
    assert torch.allclose(r1.double(), r0.double(), rtol=tol, atol=0)
    scale = max(1.0, float(d0.abs().amax())) if d0.numel() else 1.0
    assert torch.allclose(d1.double(), d0.double(), rtol=tol, atol=tol * scale)


def test_triton_norm_non_contiguous_and_nan():
    x = torch.randn(16, 6).t()  # non-contiguous rows of 16
    x[2, 3] = float("nan")
    x.requires_grad_(True)
    z = MSRMSNorm(16, use_triton=True)(x)
    assert torch.isnan(z[2]).all() and torch.isfinite(z[0]).all()
    z.sum().backward()
    assert torch.isnan(x.grad[2]).all() and torch.isfinite(x.grad[0]).all()


@pytest.mark.parametrize("cls", [MSLayerNorm, MSRMSNorm])
@pytest.mark.parametrize("use_triton", [False, True])
def test_double_backward_is_refused_not_silently_wrong(cls, use_triton):
    """σ⁻¹ is saved as a constant, so a Hessian-vector product through the norm would be off by 0.3–2: refused."""
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    z = cls(16, use_triton=use_triton)(x)
    with pytest.raises(RuntimeError, match="first-order reverse-mode autograd only"):
        torch.autograd.grad(z.pow(3).sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(cls(16, use_triton=use_triton)(x).pow(3).sum(), x)  # first order: as before
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("cls", [nn.LayerNorm, nn.RMSNorm])
def test_kept_affine_saves_what_the_merge_saves_and_its_gradients_are_exact(cls):
    """keep_affine: α, β stay trainable Parameters; q, k, v save only the shared z (4 + 4/768 bytes per element in
    fp32, as the merged form) and every gradient equals autograd through the stock norm and Linears."""
    from approxbp.kernels.rewrite.norm_merge import keep_affine

    torch.manual_seed(0)
    ln = cls(48).double()
    qkv = [nn.Linear(48, 16).double() for _ in range(3)]
    with torch.no_grad():
        ln.weight.normal_()
        if getattr(ln, "bias", None) is not None:
            ln.bias.normal_()
    x = torch.randn(5, 7, 48, dtype=torch.float64, requires_grad=True)
    params = [p for m in (ln, *qkv) for p in m.parameters()]
    stock = lambda: sum(m(ln(x)).sin().sum() for m in qkv)  # noqa: E731
    ref = torch.autograd.grad(stock(), [x, *params])
    ms, wrapped = keep_affine(ln, qkv)
    def ours():
        z = ms(x)
        return sum(m(z).sin().sum() for m in wrapped)

    got = torch.autograd.grad(ours(), [x, *params])
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    sines = 3 * 5 * 7 * 16 * 8  # each sin saves its input
    assert saved_bytes(ours, params) == 5 * 7 * 48 * 8 + 5 * 7 * 8 + sines  # z and σ⁻¹ (fp64), once for all three
    assert [n for n, _ in ms.named_parameters()] == [n for n, _ in ln.named_parameters()]


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----


SPECIAL = st.sampled_from([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, -1e-40, 0.0, -0.0,
                           1e4, -1e4, 1e20])


@pytest.mark.parametrize("use_triton", [False, True])
def test_ms_norm_overflow_behaves_like_torch(use_triton):
    x = torch.tensor([[1e20, 2e20, 3e20, -1e20], [1.0, 2.0, 3.0, 4.0]])
    ln = torch.nn.LayerNorm(4, elementwise_affine=False)(x)
    rms = torch.nn.RMSNorm(4, elementwise_affine=False)(x)
    ours_ln, ours_rms = MSLayerNorm(4, use_triton=use_triton)(x), MSRMSNorm(4, use_triton=use_triton)(x)
    assert torch.equal(ours_ln.isnan(), ln.isnan()) and ours_ln[0].isnan().all()
    assert torch.allclose(ours_ln[1], ln[1], atol=1e-6)
    assert torch.allclose(ours_rms, rms, atol=1e-6, equal_nan=True)


@settings(max_examples=20)
@given(values=st.lists(st.one_of(SPECIAL, st.floats(-50, 50, width=32)), min_size=4, max_size=4),
       center=st.booleans(), use_triton=st.booleans())
def test_adversarial_inputs_norms(values, center, use_triton):
    m = (MSLayerNorm if center else MSRMSNorm)(4, use_triton=use_triton)
    x = torch.tensor([values, [1.0, -2.0, 3.0, 0.5]], requires_grad=True)
    z = m(x)
    z.sum().backward()
    ref = (torch.nn.LayerNorm if center else torch.nn.RMSNorm)(4, elementwise_affine=False)(x.detach())
    assert torch.allclose(z[1], ref[1], atol=1e-5)  # a bad row leaves the other rows alone
    if torch.isnan(x.detach()[0]).any():
        assert torch.isnan(z[0]).all() and torch.isnan(x.grad[0]).all()
    assert torch.isfinite(x.grad[1]).all()
    assert not math.isnan(float(z[1].sum()))


def test_a_non_contiguous_input_gives_the_stock_layout():
    """Issue 59 item 2 (layout): a vision tower hands its final norm a transposed input; torch's norms return a
    contiguous tensor, the MS-norm kept the input's strides, and a reader's .view failed (SmolVLM with its images
    could not be patched). z, and the shared output α⊙z + β, are laid out as the replaced norm lays out y:
    contiguous for torch's norms, the input's strides for one written in elementwise ops (Gemma 3's q_norm on a
    transposed q, whose saving depends on it: benchmarks/model_coverage.py)."""
    from approxbp.kernels import patch_model
    from torch import nn

    x = torch.randn(2, 16, 5).transpose(1, 2)
    assert not x.is_contiguous()
    for ms, stock in ((MSLayerNorm(16), nn.LayerNorm(16)), (MSRMSNorm(16, eps=1e-6), nn.RMSNorm(16, eps=1e-6))):
        z = ms(x)
        assert z.is_contiguous() and z.stride() == stock(x).stride()

    class ViewReader(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 4)

        def forward(self, h):
            return self.proj(self.norm(h).view(-1, 16))

    model = ViewReader()
    report = patch_model(model, example_input=x)
    assert report.norms and not report.skipped, report
    assert model(x).shape == (10, 4)

    class ElementwiseRMSNorm(nn.Module):  # as Gemma's q_norm: elementwise ops keep the input's strides
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, h):
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = ElementwiseRMSNorm(), nn.Linear(16, 4)

        def forward(self, h):
            return self.proj(self.norm(h))

    stock, model = Reader(), Reader()
    patch_model(model, example_input=x)
    assert type(model.norm).__name__.startswith("MSRMSNorm")
    assert model.norm(x).stride() == stock.norm(x).stride() != (80, 16, 1)  # the stock norm's own layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_eps_none_is_the_compute_dtypes_epsilon_as_torch(dtype):
    """Issue 59 item 2 (eps): MSRMSNorm(eps=None) used the input dtype's epsilon where torch's rms_norm uses that of
    the dtype it computes in (fp32 for fp16/bf16): a bf16 row of 0.05 gave 0.996 where torch gives 1."""
    x = torch.full((2, 8), 0.05, dtype=dtype)
    want = nn.RMSNorm(8, eps=None, elementwise_affine=False)(x)
    got = MSRMSNorm(8, eps=None)(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
