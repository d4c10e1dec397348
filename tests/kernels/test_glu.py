"""The exact fused GLU (kernels/ops/glu.py): every generated module is what codegen renders, the Triton kernels equal
the PyTorch twin under TRITON_INTERPRET=1, both give torch's own act(g)·u gradients, and the op saves g and u only."""

import pytest
import torch
import torch.nn.functional as F
from approxbp.kernels import saved_bytes
from approxbp.kernels.codegen import glu_module_path, render_glu
from approxbp.kernels.ops.glu import GLU_ACTIVATIONS, GatedMLP, GLULayout, GLUSpec, glu
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

#: torch's own forms of each activation (independent of the sympy registry the kernels come from).
TORCH = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
         "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "mish": F.mish}


def test_codegen_and_runtime_agree_on_the_activations():
    from approxbp.kernels.codegen import GLU_ACTIVATIONS as BUILT

    assert BUILT == GLU_ACTIVATIONS and set(TORCH) == set(GLU_ACTIVATIONS)


@pytest.mark.parametrize("act", GLU_ACTIVATIONS)
def test_committed_module_is_what_codegen_renders(act):
    assert glu_module_path(act).read_text() == render_glu(act), "run `approxbp export`"


def _grads(fn, g, u, dh):
    gi, ui = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    h = fn(gi, ui)
    h.backward(dh)
    return h.detach(), gi.grad, ui.grad


@pytest.mark.parametrize("act", GLU_ACTIVATIONS)
@pytest.mark.parametrize("use_triton", [False, True])
@given(n=st.integers(0, 5000), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2**16))
def test_float64_values_and_gradients_equal_torchs(act, use_triton, n, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    g, u, dh = (scale * torch.randn(3, n, generator=gen, dtype=torch.float64)).unbind(0)
    ours = _grads(lambda a, b: glu(a, b, GLUSpec(act), use_triton), g, u, dh)
    stock = _grads(lambda a, b: TORCH[act](a) * b, g, u, dh)
    for a, b in zip(ours, stock):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12 * scale ** 3), (a - b).abs().max()


@pytest.mark.parametrize("act", GLU_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernels_equal_the_twin_in_every_dtype(act, dtype):
    gen = torch.Generator().manual_seed(1)
    g, u, dh = (4 * torch.randn(3, 4097, generator=gen)).to(dtype).unbind(0)
    spec = GLUSpec(act)
    # the kernel's oracle: the generated twin in fp32, rounded once, as the kernel rounds (the CPU path itself returns
    # torch's act(g) rounded to the dtype, times u: the stock gated MLP's value, test_cpu_path_is_the_stock_value)
    h_twin = (spec.module.activation_twin(g.float()) * u.float()).to(dtype)
    h_kernel = spec.forward_triton(g, u)
    # float32: two float32 evaluations of differently lowered forms (a few ulp); 16-bit: one rounding, either side
    ulp = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert h_kernel.dtype == dtype and torch.allclose(h_kernel.float(), h_twin.float(), rtol=ulp, atol=ulp)
    for a, b in zip(spec.backward_triton(dh, g, u), spec.backward_torch(dh, g, u)):
        assert torch.allclose(a.float(), b.float(), rtol=ulp, atol=ulp * 4)


def test_saves_g_and_u_only():
    g = torch.randn(64, 32, requires_grad=True)
    u = torch.randn(64, 32, requires_grad=True)
    spec = GLUSpec("silu")
    stock = saved_bytes(lambda: F.silu(g) * u)
    ours = saved_bytes(lambda: glu(g, u, spec))
    assert ours == 2 * 64 * 32 * 4 and stock == 3 * 64 * 32 * 4


def test_chunks_of_a_fused_projection_keep_one_storage():
    """Fused gate/up: g and u are halves of one tensor. Stock saves that tensor and act(g); the op saves it alone."""
    gu = torch.randn(64, 64, requires_grad=True)
    g, u = gu.chunk(2, dim=-1)
    stock = saved_bytes(lambda: F.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1])
    ours = saved_bytes(lambda: glu(*(t * 1 for t in (g, u)), GLUSpec("silu")))
    fused = saved_bytes(lambda: glu(*(gu * 1).chunk(2, -1), GLUSpec("silu")))
    assert fused == 64 * 64 * 4 and ours == 64 * 64 * 4 and stock == 64 * 64 * 4 + 64 * 32 * 4


def test_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="one floating shape and dtype"):
        glu(torch.randn(3), torch.randn(4), GLUSpec("silu"))
    with pytest.raises(ValueError, match="no exact GLU for 'relu'"):
        GLUSpec("relu")


class _SwiGLU(nn.Module):
    def __init__(self, d=16, f=24, fused=False):
        super().__init__()
        self.config, self.fused = {"hidden": d}, fused
        if fused:
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        else:
            self.gate_proj, self.up_proj = nn.Linear(d, f), nn.Linear(d, f)
        self.down_proj, self.act_fn = nn.Linear(f, d), nn.SiLU()

    def forward(self, x):
        if self.fused:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act_fn(g) * u)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("fused", [False, True])
def test_gated_mlp_keeps_state_dict_attributes_and_gradients(fused):
    torch.manual_seed(0)
    stock = _SwiGLU(fused=fused).double()
    layout = GLULayout("gate_up_proj", None, "down_proj") if fused else GLULayout("gate_proj", "up_proj", "down_proj")
    ours = GatedMLP(stock, layout, "silu")
    assert ours.state_dict().keys() == stock.state_dict().keys() and ours.config is stock.config
    x = torch.randn(5, 16, dtype=torch.float64)
    outs = []
    for m in (stock, ours):
        m.zero_grad()
        y = m(x)
        y.square().sum().backward()
        outs.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.allclose(outs[0][0], outs[1][0], rtol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(outs[0][1], outs[1][1]))


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.slow
def test_compiles_with_zero_graph_breaks_and_exports(use_triton):
    torch.manual_seed(0)
    model = GatedMLP(_SwiGLU(), GLULayout("gate_proj", "up_proj", "down_proj"), "silu", use_triton=use_triton)
    x = torch.randn(4, 16, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = model(x)
    eager.sum().backward()
    grad, x.grad = x.grad.clone(), None
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True)(x)
    out.sum().backward()
    assert torch.allclose(out, eager, atol=1e-6) and torch.allclose(x.grad, grad, atol=1e-6)
    program = torch.export.export(model, (x.detach(),))
    assert "approxbp.glu_forward" in str(program.graph)
