"""What the drop-ins' autograd supports: first-order reverse mode through every entry (backward, autograd.grad,
torch.func.grad, vjp, jacrev), all giving the same approximate gradient; a second derivative, forward-mode AD and
vmap are refused in one line that says what works, never answered with a wrong or an exact number."""

import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from approxbp.kernels import InvActGELU, MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2
from approxbp.kernels.ops.custom_ops import FIRST_ORDER_ONLY

DROP_INS = [MSLayerNorm(8), MSRMSNorm(8), ReGELU2(), ReSiLU2(), InvActGELU()]
REFUSAL = re.escape(FIRST_ORDER_ONLY.split(";")[0])


def _x():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 8, dtype=torch.float64, generator=g), torch.randn(3, 8, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("m", DROP_INS, ids=lambda m: type(m).__name__)
def test_every_first_order_entry_gives_the_same_gradient(m):
    x, u = _x()
    xg = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(m(xg), xg, u)
    assert torch.equal(torch.func.grad(lambda t: (m(t) * u).sum())(x), want)
    _, vjp = torch.func.vjp(m, x)
    assert torch.equal(vjp(u, create_graph=False)[0], want)
    with pytest.raises(RuntimeError, match=REFUSAL):  # its default, create_graph=True, builds a second derivative
        vjp(u)
    jac = torch.func.jacrev(lambda t: (m(t) * u).sum(0))(x)  # (8, 3, 8): d out_j / d x
    torch.testing.assert_close(jac.sum(0), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", DROP_INS, ids=lambda m: type(m).__name__)
def test_a_second_derivative_is_refused(m):
    """MSLayerNorm returned a second derivative off by 2.0 against F.layer_norm with no error."""
    x, u = _x()
    xg = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=REFUSAL):  # refused when the graph of the gradient is asked for
        torch.autograd.grad(m(xg), xg, u, create_graph=True)
    with pytest.raises(RuntimeError, match=REFUSAL):
        torch.func.grad(lambda t: torch.func.grad(lambda s: m(s).sum())(t).sum())(x)


@pytest.mark.parametrize("m", DROP_INS, ids=lambda m: type(m).__name__)
def test_forward_mode_and_vmap_are_refused(m):
    """jvp returned the exact f′ while reverse mode returns the approximation."""
    x, u = _x()
    with pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.func.jvp(m, (x,), (u,))
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        m(fwAD.make_dual(x, u))
    with pytest.raises(RuntimeError, match="vmap"):
        torch.func.vmap(m)(x)


def test_inference_without_grad_still_takes_the_fast_path():
    """Outside autograd and torch.func, a drop-in runs its twin's forward only (no codes, no Function)."""
    x, _ = _x()
    with torch.no_grad():
        y = ReGELU2()(x)
    assert y.grad_fn is None and torch.equal(y, ReGELU2()(x).detach())


def _norm_models():
    from torch import nn

    torch.manual_seed(0)
    yield "sequential", nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                                      nn.Linear(16, 4)).double(), torch.randn(5, 8, dtype=torch.float64)
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("llama", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=32, vocab_size=30)
    llama = transformers.AutoModelForCausalLM.from_config(config).double()
    yield "llama", llama, torch.randint(0, 30, (2, 6))


def test_torch_func_grad_goes_through_the_norm_rewrite():
    """Issue 59 item 5: torch.func.grad through a model with norms rewritten failed ("must override setup_context"):
    the rewrite's own Functions (a consumer Linear reading z, one reading the shared y, the shared output's α⊙z + β)
    were old-style. Written as the drop-ins' ops are, the gradient through torch.func equals the stock model's
    (the norms' rewrite is exact); vmap is refused in the drop-ins' one line."""
    import copy

    from approxbp.kernels import patch_model
    from torch.func import functional_call, grad, vmap

    for name, model, x in _norm_models():
        stock = copy.deepcopy(model)
        report = patch_model(model, family=None, glu=False, example_input=x)
        assert report.norms, (name, report)

        def loss(params, m, x=x):
            out = functional_call(m, params, (x,))
            return (out.logits if hasattr(out, "logits") else out).pow(2).sum()

        got = grad(loss)({k: v.detach() for k, v in model.named_parameters()}, model)
        loss(dict(model.named_parameters()), model).backward()
        for k, p in model.named_parameters():  # torch.func gives what loss.backward() gives (up to summation order)
            torch.testing.assert_close(got[k], p.grad, rtol=1e-12, atol=1e-15, msg=f"{name} {k}")
        if name == "sequential":  # float64 throughout, so also the stock gradient (HF's RMSNorm computes in fp32)
            want = grad(loss)({k: v.detach() for k, v in stock.named_parameters()}, stock)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=f"{name} {k}")
        if name == "sequential":
            with pytest.raises(RuntimeError, match=re.escape(FIRST_ORDER_ONLY[:40])):
                vmap(lambda xi, m=model: m(xi))(x)
