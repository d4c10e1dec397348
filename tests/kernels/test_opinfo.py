"""Issue 59 item 6: PyTorch's own OpInfo sample inputs (``torch.testing._internal``) through every drop-in.

For each activation torch has an op for (gelu, tanh-gelu, silu, mish, softplus, elu, selu, celu, hardswish,
hardsigmoid, relu6, hardtanh) and each packaged table of it (every InvAct form, one ReLU-sum table per
activation), and for the two norms: the forward on the CPU path equals torch's op bit for bit in the input's dtype
(fp16, bf16, fp32, fp64), with the same NaN pattern, dtype and strides — on the OpInfo samples as given, transposed
and non-contiguous, and on edge rows (±0, ±inf, NaN, 1e±30, subnormals) — with and without grad. The backward is
the family's rule: a ReLU-sum table's dx is dy·level[#{knots < x}] exactly (its levels and knots read from the
table, compared in fp32 as the kernels compare), an InvAct table's within its certified L∞ of dy·f′(x). Refusals:
a norm refuses what torch's norm refuses (a 0-dim input, another last dimension). Compiled (slow): the same values
and strides under torch.compile, transposed inputs included.
"""

from __future__ import annotations

import functools

import pytest
import torch
from approxbp.approximations import tables as table_files
from approxbp.approximations.gradient_error import invact_error
from approxbp.kernels import InvActivation, MSLayerNorm, MSRMSNorm, ReLUSumActivation
from torch.nn import functional as F

common_methods_invocations = pytest.importorskip("torch.testing._internal.common_methods_invocations")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
#: activation → (OpInfo name, the sample kwargs its drop-ins compute, torch's op)
ACTIVATIONS = {
    "gelu": ("nn.functional.gelu", {"approximate": "none"}, F.gelu),
    "gelu_tanh": ("nn.functional.gelu", {"approximate": "tanh"}, functools.partial(F.gelu, approximate="tanh")),
    "silu": ("nn.functional.silu", {}, F.silu),
    "mish": ("nn.functional.mish", {}, F.mish),
    "softplus": ("nn.functional.softplus", {}, F.softplus),
    "elu": ("nn.functional.elu", {}, F.elu),
    "selu": ("nn.functional.selu", {}, F.selu),
    "celu": ("nn.functional.celu", {}, F.celu),
    "hardswish": ("nn.functional.hardswish", {}, F.hardswish),
    "hardsigmoid": ("nn.functional.hardsigmoid", {}, F.hardsigmoid),
    "relu6": ("nn.functional.relu6", {}, F.relu6),
    "hardtanh": ("nn.functional.hardtanh", {}, F.hardtanh),
}
EDGE = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 1e-30, -1e-30, 3.0, -3.0,
                     6.0, -1.0, 1.0, 20.0, 25.0, -50.0, 1e-40, -1e-40], dtype=torch.float64)


def _drop_ins(activation: str) -> list[str]:
    """Every packaged InvAct table of ``activation`` and its k = 2 primitive ReLU-sum table (where it has one)."""
    names = [p.stem for p in table_files.table_paths()]
    invact = [n for n in names if n.split("-")[0] == activation and "-k" not in n]
    relu_sum = [n for n in names if n == f"{activation}-k2-primitive"]
    return [f"invact:{n}" for n in invact] + [f"relu-sum:{n}" for n in relu_sum]


CASES = [(a, d) for a in ACTIVATIONS for d in _drop_ins(a)]


@functools.cache
def _module(drop_in: str):
    family, name = drop_in.split(":")
    return (InvActivation if family == "invact" else ReLUSumActivation)(name, use_triton=False)


@functools.cache
def _opinfo(name: str):
    return next(op for op in common_methods_invocations.op_db if op.name == name and op.variant_test_name == "")


def _inputs(activation: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The OpInfo samples whose kwargs are the function the drop-in computes (or whose kwargs only change the
    function: then their input with the drop-in's own function), each also transposed and non-contiguous, and the
    edge rows; in ``dtype``."""
    op_name, kwargs, _ = ACTIVATIONS[activation]
    xs = [s.input for s in _opinfo(op_name).sample_inputs("cpu", dtype, requires_grad=False)
          if not s.kwargs or s.kwargs.get("approximate", kwargs.get("approximate")) == kwargs.get("approximate")]
    xs.append(EDGE.to(dtype))
    variants = []
    for x in xs:
        variants.append(x)
        if x.dim() >= 2:
            variants.append(x.transpose(0, -1))
        if x.numel() > 1:
            variants.append(x.repeat_interleave(2, dim=-1)[..., ::2])  # non-contiguous, same values
    return variants


def _assert_stock(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.numel() > 1:
        assert got.stride() == want.stride(), (got.stride(), want.stride())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation,drop_in", CASES, ids=[d for _, d in CASES])
def test_activation_forward_is_torchs_op_bit_for_bit(activation, drop_in, dtype):
    module, op = _module(drop_in), ACTIVATIONS[activation][2]
    for x in _inputs(activation, dtype):
        want = op(x)
        with torch.no_grad():
            _assert_stock(module(x), want)
        _assert_stock(module(x.detach().requires_grad_()).detach(), want)


def _relu_sum_rule(spec, x: torch.Tensor) -> torch.Tensor:
    """h̃′(x) = level[#{knots < x}] from the table (fp32 comparisons, as the kernels make them)."""
    knots = torch.tensor(spec.table.knots, dtype=torch.float32)
    levels = torch.tensor(spec.table.levels, dtype=torch.float64)
    return levels[torch.bucketize(x.float(), knots)]


def _derivative(activation: str, x: torch.Tensor):
    """side → f′ at x (side 0), just below (−1) or just above (+1) x, by autograd through torch's op in float64;
    softplus's as σ(x) (torch's softplus backward is 1 beyond its threshold of 20, not the derivative)."""
    op = torch.sigmoid if activation == "softplus" else None

    def at(side: int) -> torch.Tensor:
        t = x if side == 0 else torch.nextafter(x, torch.full_like(x, side * float("inf")))
        if op is not None:
            return op(t)
        t = t.clone().requires_grad_()
        return torch.autograd.grad(ACTIVATIONS[activation][2](t), t, torch.ones_like(t))[0]
    return at


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("activation,drop_in", CASES, ids=[d for _, d in CASES])
def test_activation_backward_is_the_familys_rule(activation, drop_in, dtype):
    module = _module(drop_in)
    for x in _inputs(activation, dtype):
        x = x[torch.isfinite(x)] if x.dim() else x  # (the NaN pattern of the backward: test_relu_sum_kernels)
        if not bool(torch.isfinite(x).all()):
            continue
        x = x.detach().requires_grad_()
        dy = torch.linspace(-2, 3, x.numel(), dtype=dtype).reshape(x.shape) if x.numel() else torch.ones_like(x)
        (dx,) = torch.autograd.grad(module(x), x, dy)
        assert dx.dtype == x.dtype and dx.shape == x.shape
        if drop_in.startswith("relu-sum"):
            want = dy.double() * _relu_sum_rule(module.spec, x.detach())
            torch.testing.assert_close(dx.double(), want, rtol=2e-7, atol=1e-30)
            continue
        if dtype is not torch.float64:  # an fp32 y carries its rounding through f⁻¹, ill-conditioned near the turning
            continue                    # point: the certificate is a float64 statement (fp32: test_invact_kernels)
        fp = _derivative(activation, x.detach().double())
        smooth = (fp(-1) - fp(1)).abs() < 1e-6  # at a kink (ReLU6 at 0 and 6, ELU at 0) either side is the rule's
        exact = dy.double() * fp(0)
        # the certified L∞, and one fp32 rounding of the rule's constants (hard-sigmoid's 1/6 is an fp32 literal)
        bound = invact_error(table_files.stored_metrics(module.spec.path)) + 2.0**-24
        err = (dx.double() - exact).abs()[smooth]
        assert bool((err <= bound * dy.double().abs()[smooth] + 1e-30).all()), (drop_in, err.max())


NORMS = {"layer_norm": (MSLayerNorm, F.layer_norm), "rms_norm": (MSRMSNorm, F.rms_norm)}


def _norm_samples(name: str, dtype: torch.dtype):
    """(input, eps) of the OpInfo samples over one last dimension without weight or bias, transposed and
    non-contiguous too, and edge rows (zeros, 1e30, NaN, inf)."""
    out = []
    for s in _opinfo(f"nn.functional.{name}").sample_inputs("cpu", dtype, requires_grad=False):
        shape = s.args[0]
        if len(shape) != 1:
            continue
        eps = s.kwargs.get("eps", 1e-5)
        x = s.input
        out.append((x, eps))
        if x.dim() >= 2 and x.shape[0] > 1:
            out.append((x.transpose(0, -2).contiguous().transpose(0, -2), eps))
    d = 4
    rows = torch.tensor([[0.0] * d, [1e30] * d, [1e30, -1e30] * (d // 2), [1.0, float("nan"), 2.0, 3.0],
                         [1.0, float("inf"), 2.0, 3.0], [1e-30, 2e-30, 0.0, -1e-30]], dtype=torch.float64).to(dtype)
    out.append((rows, 1e-5))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(NORMS))
def test_norm_forward_is_torchs_op_bit_for_bit(name, dtype):
    cls, op = NORMS[name]
    for x, eps in _norm_samples(name, dtype):
        d = x.shape[-1]
        want = op(x, (d,), eps=eps)
        with torch.no_grad():
            _assert_stock(cls(d, eps=eps, use_triton=False)(x), want)
        got = cls(d, eps=eps, use_triton=False)(x.detach().requires_grad_())
        _assert_stock(got.detach(), want)
        if x.numel() and bool(torch.isfinite(x).all()) and eps > 0:
            got.backward(torch.ones_like(got))  # the backward runs for every sample (a zero-width row included)


@pytest.mark.parametrize("name", list(NORMS))
def test_norm_refuses_what_torch_refuses(name):
    cls, op = NORMS[name]
    for x, d in [(torch.tensor(1.0), 1), (torch.randn(2, 3), 4)]:
        with pytest.raises((RuntimeError, ValueError)):
            op(x, (d,))
        with pytest.raises(ValueError, match="expects last dimension"):
            cls(d)(x)


@pytest.mark.slow
@pytest.mark.parametrize("drop_in", ["relu-sum:gelu-k2-primitive", "invact:gelu-fast", "invact:silu-fast"])
def test_compiled_drop_in_keeps_values_and_layout(drop_in):
    """Under torch.compile the custom op's fake declares the layout eager returns (x's, as torch's elementwise ops):
    a transposed input used to crash there."""
    module = _module(drop_in)
    op = ACTIVATIONS[drop_in.split(":")[1].split("-")[0]][2]
    compiled = torch.compile(lambda t: module(t), backend="aot_eager", fullgraph=True)
    x = torch.randn(6, 5).t().requires_grad_()
    y = compiled(x)
    _assert_stock(y.detach(), op(x.detach()))
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NORMS))
def test_compiled_norm_keeps_values_and_layout(name):
    cls, op = NORMS[name]
    module = cls(5, use_triton=False)
    compiled = torch.compile(lambda t: module(t), backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 6).t().requires_grad_()
    y = compiled(x)
    _assert_stock(y.detach(), op(x.detach(), (5,), eps=1e-5))
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape
