"""Memory-sharing norms (Approx-BP App. G): exact merge, exact gradients, measured sharing."""

import pytest
import torch
from approxbp.kernels import MSLayerNorm, MSRMSNorm, merge_norm, saved_bytes
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
