"""One description per op (``custom_ops.Op``): its custom op (what dynamo and dispatch modes see) and its eager
Function save the same tensors and give the same gradients, for every family's op."""

import pytest
import torch
from approxbp.kernels import InvActGELU, ReGELU2
from approxbp.kernels.ops import custom_ops
from approxbp.kernels.ops.glu import GLU, GLUSpec
from approxbp.kernels.ops.invact import INVACT
from approxbp.kernels.ops.norms import MS_NORM
from approxbp.kernels.ops.relu_sum import RELU_SUM


def _cases():
    x = torch.randn(6, 40, dtype=torch.float64)
    silu = custom_ops.checked_and_registered(GLUSpec("silu"), False)
    return {"relu_sum": (RELU_SUM, (x,), (ReGELU2().spec.key, False)),
            "invact": (INVACT, (x,), (InvActGELU().spec.key, False, None)),
            "ms_norm": (MS_NORM, (x,), (1e-5, True, False, None)),
            "glu": (GLU, (x, torch.randn_like(x)), (silu.key, False))}


def _run(op, tensors, options, opaque: bool):
    """(output, gradients, what autograd saved: (shape, dtype) of each tensor) through one entry point."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        if opaque:
            with custom_ops.as_kernels():
                out = op(*leaves, *options)
        else:
            out = op(*leaves, *options)
    y = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(y, leaves, torch.ones_like(y))
    return y.detach(), grads, sorted(saved, key=str)


@pytest.mark.parametrize("name", ["relu_sum", "invact", "ms_norm", "glu"])
def test_the_custom_op_and_the_eager_function_save_the_same_tensors(name):
    op, tensors, options = _cases()[name]
    y_op, g_op, saved_op = _run(op, tensors, options, opaque=True)
    y_fn, g_fn, saved_fn = _run(op, tensors, options, opaque=False)
    assert torch.equal(y_op, y_fn)
    assert all(torch.equal(a, b) for a, b in zip(g_op, g_fn, strict=True))
    assert saved_op == saved_fn and saved_fn  # the one save policy, through both entry points


def test_the_two_entry_points_differ_where_the_description_does():
    """The check above can fail: an op whose save policy saves an extra tensor saves it through both entry points,
    so its saved list differs from the family's."""
    import approxbp.kernels.ops.custom_ops as co

    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale

    def backward(g: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
        return g * scale

    op = co.Op("test_scale", forward, backward, saves=lambda inputs, out: (inputs[0],),
               options=lambda x, scale: (scale,),
               fakes=(lambda x, scale: torch.empty_like(x), lambda g, x, scale: torch.empty_like(g)))
    x = torch.randn(3, 4)
    for opaque in (True, False):
        y, (g,), saved = _run(op, (x,), (2.0,), opaque)
        assert torch.equal(y, x * 2) and torch.equal(g, torch.full_like(x, 2.0)) and saved == [((3, 4), x.dtype)]


def test_a_custom_op_takes_no_mask():
    with pytest.raises(ValueError, match="no mask"):
        custom_ops.Op("test_masked", lambda x: x, lambda needs, g: g, saves=lambda i, o: (),
                      fakes=(lambda x: x, lambda g: g), masked=True)

