"""Every Triton path works for every dtype its module accepts (under TRITON_INTERPRET=1, set in conftest), and
agrees with its PyTorch twin there: on a GPU the Triton path is the default, so a dtype it refuses is a crash."""

import numpy as np
import pytest
import torch
from _accuracy import tolerance_ok
from approxbp.approximations import get_activation
from approxbp.approximations import tables as table_files
from approxbp.kernels.ops import bdia as KB
from approxbp.kernels.ops.norms import MSLayerNorm, MSRMSNorm
from approxbp.kernels.ops.relu_sum import ReLUSumActivation, ReLUSumSpec

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
#: The interpreter's fp32 → bf16 conversion rounds ties away and drops the carry (README): bf16 results are compared
#: to within ulps there; on a GPU they are round-to-nearest-even, as the twin.
INTERPRETER_BF16 = "the Triton interpreter does not round fp32 → bf16 to nearest even"


@pytest.mark.parametrize("name", ["gelu-k2-primitive", "silu-k5-derivative"])
def test_relu_sum_triton_float64_equals_twin(name):
    spec = ReLUSumSpec(table_files.resolve(name, "relu-sum"))
    x = torch.cat([torch.linspace(-9, 9, 1001, dtype=torch.float64), torch.tensor(spec.table.knots).double()])
    y1, p1, n1 = spec.forward_triton(x)
    y0, p0, n0 = spec.forward_torch(x)
    assert y1.dtype == torch.float64 and torch.equal(p1, p0) and torch.equal(n1, n0)
    truth = torch.tensor(np.asarray(get_activation(spec.table.expression).f(x.numpy())))
    assert tolerance_ok(y1, y0, truth, x, spec.table.activation)  # computed in float64, as the twin
    g = torch.randn_like(x)
    assert torch.equal(spec.backward_triton(g, p1, n1, x.numel()), spec.backward_torch(g, p0, n0, x.numel()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_sum_module_every_dtype(dtype):
    x = (3 * torch.randn(3, 257, generator=torch.Generator().manual_seed(0))).to(dtype)
    grads = []
    for use_triton in (True, False):
        xi = x.clone().requires_grad_(True)
        ReLUSumActivation("gelu-k3-primitive", use_triton=use_triton)(xi).sum().backward()
        grads.append(xi.grad)
    assert grads[0].dtype == dtype
    if dtype is torch.bfloat16:  # INTERPRETER_BF16
        assert torch.allclose(grads[0].float(), grads[1].float(), rtol=2 * torch.finfo(dtype).eps, atol=0)
    else:
        assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bdia_triton_every_dtype_equals_twin_and_inverts_exactly(dtype):
    gen = torch.Generator().manual_seed(1)
    level = 3
    x_prev, x = ((torch.randn(4, 96, generator=gen) * 8).round() / 8).to(dtype).unbind(0)[:2]
    x_prev, x = x_prev.view(2, 48), x.view(2, 48)
    hx = torch.randn(2, 48, generator=gen).to(dtype)  # off the grid: the mix rounds in `dtype`
    gamma = torch.tensor([0.5, -0.5])
    out, bits = KB.step_triton(x_prev, x, hx, gamma, level)
    ref, ref_bits = KB.step_torch(x_prev, x, hx, gamma, level)
    assert out.dtype == dtype and torch.equal(bits, ref_bits)
    back = KB.inverse_triton(x, out, hx, bits, gamma, level)
    assert torch.equal(back, x_prev)  # exact reversibility of the kernels' own step
    if dtype is torch.bfloat16:  # INTERPRETER_BF16: the mix may round one way in the twin and the other here
        assert (out.double() - ref.double()).abs().max() <= 2.0**-level
    else:
        assert torch.equal(out, ref)
        assert torch.equal(back, KB.inverse_torch(x, ref, hx, ref_bits, gamma, level))


@pytest.mark.parametrize("cls", [MSLayerNorm, MSRMSNorm])
@pytest.mark.parametrize("d", [8, 768])
def test_ms_norm_huge_rows_agree_with_twin(cls, d):
    """The twin is torch's own norm without affine, bit for bit (on the CPU a constant row of 1e30 is NaN there: its
    variance overflows in torch's own formula); the kernel centres that row to exactly 0 (shifted by its first
    element, as CUDA's Welford norm gives); a row whose variance overflows is NaN in both, as torch's LayerNorm."""
    x = torch.stack([torch.full((d,), 1e30), torch.tensor([1e30, -1e30] * (d // 2)), torch.randn(d)])
    a = cls(d, use_triton=True)(x)
    b = cls(d, use_triton=False)(x)
    torch_op = torch.nn.functional.layer_norm if cls is MSLayerNorm else torch.nn.functional.rms_norm
    torch.testing.assert_close(b, torch_op(x, (d,), eps=1e-5), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a[1:].isnan(), b[1:].isnan()) and torch.allclose(a[1:].nan_to_num(), b[1:].nan_to_num(),
                                                                       atol=1e-5)
    if cls is MSLayerNorm:
        assert torch.equal(a[0], torch.zeros(d)) and a[1].isnan().all()
    else:
        assert torch.equal(a[0].isnan(), b[0].isnan())
