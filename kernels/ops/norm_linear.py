"""The ops of a merged norm's readers (Approx-BP App. G, eq. 58) when its affine (α, β) stays the model's own: the
rewrite (``rewrite/norm_merge.py``) keeps the MS-norm's z as the one saved tensor and has each reader recompute
u = α⊙z + β. Every gradient is exact (the backwards are differentiable ops), so each is a :class:`~.custom_ops.Op`
with an eager Function only: dynamo traces them, and nothing here needs a custom op's opacity.

    NORM_INPUT_LINEAR(z, W, b, α, β) = (α⊙z + β)·Wᵀ + b      saves z, W, α, β (references)
    SAVES_Z_LINEAR(y, z, W, b, α, β) = y·Wᵀ + b              saves z, W, α, β; the gradient goes to y
    AFFINE_OUT(z, α, β)              = α⊙z + β               saves z (when α trains) and α
    STOCK_OUT(z, α, β, x, w, stock)  = stock(x)              the gradient of α⊙z + β
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .custom_ops import Op

__all__ = ["AFFINE_OUT", "affine_input", "NORM_INPUT_LINEAR", "SAVES_Z_LINEAR", "STOCK_OUT"]


def affine_input(z: Tensor, alpha: Tensor | None, beta: Tensor | None) -> Tensor:
    """u = α⊙z + β in z's dtype (α or β may be absent)."""
    u = z * alpha.to(z.dtype) if alpha is not None else z
    return u + beta.to(z.dtype) if beta is not None else u


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _not_a_view(out: Tensor) -> Tensor:
    """A custom Function's output that is a view cannot be written in place by the model (data2vec-audio masks time
    steps with hidden[mask] = …), and F.linear with a bias returns a view of its 2-D product. Where the view covers
    its whole (fresh, private) base, the same storage as a plain tensor (what matmul itself does: no copy); else a
    copy."""
    base = out._base
    if base is None:
        return out
    if (out.is_contiguous() and base.is_contiguous() and out.numel() == base.numel()
            and out.storage_offset() == base.storage_offset()):
        return torch.ops.aten._unsafe_view(base, out.shape)
    return out.clone()


def _weight_grads(dy, z, weight, alpha, beta, need_w: bool, need_b: bool):
    """(dW, db) of a consumer Linear whose input is u = α⊙z + β: dW = dyᵀ·u with u recomputed from the saved z
    (never saved itself), db = Σ dy; None where not needed."""
    dw = _rows(dy).t().matmul(_rows(affine_input(z, alpha, beta)).to(dy.dtype)).to(weight.dtype) if need_w else None
    return dw, _rows(dy).sum(0).to(weight.dtype) if need_b else None


# ---- (α⊙z + β)·Wᵀ + b from the MS-norm's z ------------------------------------------------------------------------
def _norm_input_linear(z, weight, bias, alpha, beta):
    """y = (α⊙z + β)·Wᵀ + b from the MS-norm's output z (W is (out, in); Conv1D passes Wᵀ's view). Saves z (the
    tensor the MS-norm saves anyway) and references to W, α, β (parameters: no copies); u = α⊙z + β is recomputed
    in the backward. Gradients are exact: dz = (dy·W)⊙α, dW = dyᵀ·u, db = Σ dy, dα = Σ (dy·W)⊙z, dβ = Σ dy·W."""
    return _not_a_view(nn.functional.linear(affine_input(z, alpha, beta), weight, bias))


def _norm_input_linear_backward(needs, dy, z, weight, alpha, beta, has_bias):
    """In dy's dtype (autocast's, when the forward's Linear ran under it)."""
    need_z, need_w, need_b, need_a, need_beta = needs
    du = dy.matmul(weight.to(dy.dtype))  # dL/du
    dz = (du * alpha.to(du.dtype) if alpha is not None else du).to(z.dtype) if need_z else None
    dw, db = _weight_grads(dy, z, weight, alpha, beta, need_w, need_b and has_bias)
    da = (_rows(du) * _rows(z).to(du.dtype)).sum(0).to(alpha.dtype) if need_a and alpha is not None else None
    dbeta = _rows(du).sum(0).to(beta.dtype) if need_beta and beta is not None else None
    return dz, dw, db, da, dbeta


NORM_INPUT_LINEAR = Op("norm_input_linear", _norm_input_linear, _norm_input_linear_backward,
                       saves=lambda inputs, out: (inputs[0], inputs[1], *inputs[3:]),
                       options=lambda z, weight, bias, alpha, beta: (bias is not None,),
                       masked=True, exact=True, function_name="NormInputLinearFunction")


# ---- y·Wᵀ + b for a reader of a shared-output norm's y, saving z ---------------------------------------------------
def _saves_z_linear(y, z, weight, bias, alpha, beta):
    """out = y·Wᵀ + b for a consumer of a shared-output norm's y = α⊙z + β: the forward reads y (the stock value,
    computed once by the norm for all its readers), the gradient goes back to y as stock (du = dy·W, so the norm's
    own backward forms dz = du⊙α and dα, dβ once for all readers), and only z is saved (shared with the MS-norm,
    passed detached: no gradient edge), u = α⊙z + β recomputed in the backward for dW alone."""
    return _not_a_view(nn.functional.linear(y, weight, bias))


def _saves_z_linear_backward(needs, dy, z, weight, alpha, beta, has_bias, y_dtype):
    need_y, _, need_w, need_b = needs[:4]
    du = dy.matmul(weight.to(dy.dtype)).to(y_dtype) if need_y else None
    return du, None, *_weight_grads(dy, z, weight, alpha, beta, need_w, need_b and has_bias)


SAVES_Z_LINEAR = Op("saves_z_linear", _saves_z_linear, _saves_z_linear_backward,
                    saves=lambda inputs, out: (inputs[1], inputs[2], *inputs[4:]),
                    options=lambda y, z, weight, bias, alpha, beta: (bias is not None, y.dtype),
                    masked=True, exact=True, function_name="SavesZLinearFunction")


# ---- a norm's output y = α⊙z + β for readers that keep nothing for backward ---------------------------------------
def _affine_saves(inputs, out):
    """z (the MS-norm's own saved output: no new storage), and only when α trains; α."""
    z, alpha = inputs[:2]
    return z if alpha is not None and alpha.requires_grad else None, alpha


def _affine_backward(needs, dy, z, alpha):
    """dz = dy⊙α, dα = Σ dy⊙z, dβ = Σ dy."""
    dz = dy * alpha.to(dy.dtype) if alpha is not None else dy
    da = (_rows(dy) * _rows(z).to(dy.dtype)).sum(0).to(alpha.dtype) if z is not None else None
    return dz, da, _rows(dy).sum(0) if needs[2] else None


AFFINE_OUT = Op("affine_out", affine_input, _affine_backward, saves=_affine_saves, masked=True, exact=True,
                function_name="AffineOutFunction")


def _stock_out(z, alpha, beta, x, weight, stock):
    """y = the replaced norm's own output for x: its operation, rounding, dtype, NaN/Inf pattern and memory layout,
    so every reader sees the stock value bit for bit. Its gradient is that of y = α⊙z + β (:data:`AFFINE_OUT`);
    x carries no gradient here (it reaches x through z, the MS-norm's backward). ``weight`` is the norm's raw
    Parameter (α = w or 1 + w), passed so that the stock forward runs with the module's current Parameters, also
    under torch.func."""
    params = stock._parameters
    saved = dict(params)
    try:  # the stock forward on this module's Parameters (the same objects, or torch.func's stand-ins)
        params.update((k, v) for k, v in (("weight", weight), ("bias", beta)) if k in params)
        return type(stock).forward(stock, x)
    finally:
        params.update(saved)


STOCK_OUT = Op("stock_out", _stock_out, _affine_backward, saves=_affine_saves, masked=True, exact=True,
               function_name="StockOutFunction")
