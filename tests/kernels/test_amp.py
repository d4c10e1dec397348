"""Drop-ins under torch.autocast (bf16 on the CPU): they take the dtype autocast hands them and return it."""

import pytest
import torch
from approxbp.kernels import InvActGELU, InvActSiLU, MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2
from torch import nn


@pytest.mark.parametrize("make", [ReGELU2, ReSiLU2, InvActGELU, InvActSiLU, lambda: MSLayerNorm(32),
                                  lambda: MSRMSNorm(32)], ids=["ReGELU2", "ReSiLU2", "InvActGELU", "InvActSiLU",
                                                               "MSLayerNorm", "MSRMSNorm"])
@pytest.mark.parametrize("use_triton", [False, True])
def test_module_inside_autocast_bf16(make, use_triton):
    torch.manual_seed(0)
    m = make()
    if hasattr(m, "use_triton"):
        m.use_triton = use_triton
    elif use_triton:
        pytest.skip("no Triton path")
    net = nn.Sequential(nn.Linear(32, 32), m, nn.Linear(32, 8))
    ref = nn.Sequential(net[0], {"ReGELU2": nn.GELU(), "InvActGELU": nn.GELU(), "ReSiLU2": nn.SiLU(),
                                 "InvActSiLU": nn.SiLU()}.get(type(m).__name__, m), net[2])
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = net[1](net[0](x))
        out = net(x)
        out_ref = ref(x)
    assert hidden.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), out_ref.float(), rtol=0.05, atol=0.05)  # forward is exact up to bf16
    out.float().pow(2).sum().backward()
    for p in net.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
