"""A merged norm (eq. 58: α, β folded into frozen consumers, by a direct ``merge_norm``; patch_model keeps α, β
and never merges) stays exact or refuses: unfreezing the consumers, loading a stock-layout state dict and
unpatching after a cast each once changed the model without a word."""

import copy

import pytest
import torch
from approxbp.kernels import merge_norm, patch_model, patched_state_dict, unpatch
from approxbp.kernels.rewrite.norm_merge import refuse_stock_state_dicts
from torch import nn


def _frozen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.add_(torch.randn(8))
        model[0].bias.add_(torch.randn(8))
    stock = copy.deepcopy(model).requires_grad_(False)
    model.requires_grad_(False)
    model[0] = merge_norm(model[0], [model[1]])
    refuse_stock_state_dicts(model)
    return stock, model


def test_unfreezing_merged_consumers_is_refused_in_training_not_in_inference():
    """requires_grad_(True) for full fine-tuning trained W·diag α in place of W and α (loss 2.011 vs 1.908)."""
    stock, model = _frozen()
    x = torch.randn(3, 8)
    model.requires_grad_(True)
    with torch.no_grad():
        torch.testing.assert_close(model(x), stock(x))  # inference computes the same function
    with pytest.raises(RuntimeError, match="merged into frozen consumers.*unpatch"):
        model(x)
    unpatch(model)
    model(x).sum().backward()  # unpatched: trains as the stock model


def test_a_stock_state_dict_is_refused_before_anything_loads():
    """load_state_dict(stock_sd, strict=False) loaded unscaled W into merged consumers (output off by 0.20)."""
    stock, model = _frozen()
    x = torch.randn(3, 8)
    before = model(x)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match="stock layout"):
            model.load_state_dict(stock.state_dict(), strict=strict)
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)  # nothing was loaded
    with pytest.warns(UserWarning, match="not the stock layout"):
        own = model.state_dict()
    model.load_state_dict(own)  # the patched model's own layout still loads
    stock.load_state_dict(patched_state_dict(model))
    torch.testing.assert_close(stock(x), before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_unpatch_after_a_cast_restores_the_norm_in_the_new_dtype(dtype):
    """unpatch after .half() restored an fp32 norm (it is kept outside the module tree): the next forward failed
    on dtypes and patched_state_dict mixed them."""
    stock, model = _frozen()
    model.to(dtype)
    sd = patched_state_dict(model)
    assert {v.dtype for v in sd.values()} == {dtype}
    unpatch(model)
    assert {p.dtype for p in model.parameters()} == {dtype}
    x = torch.randn(3, 8, dtype=dtype)
    torch.testing.assert_close(model(x), stock.to(dtype)(x), rtol=2e-2, atol=2e-2)


def test_unpatch_keeps_a_deliberately_mixed_model_as_it_was():
    """A model whose norm was fp32 beside bf16 Linears at merge time gets its fp32 norm back (no cast happened)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4).to(torch.bfloat16)).requires_grad_(False)
    model[0].register_forward_hook(lambda m, i, o: o.to(torch.bfloat16))
    patch_model(model, family=None)  # α, β are kept (the same Parameters): the fp32 weight stays fp32
    assert model[0].weight.dtype == torch.float32
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4).to(torch.bfloat16)).requires_grad_(False)
    from approxbp.kernels.rewrite.norm_merge import unmerge_norm

    ms = merge_norm(model[0], [model[1]])
    assert unmerge_norm(ms).weight.dtype == torch.float32
