"""Memory-sharing LayerNorm and RMSNorm (Approx-BP §5.2, App. G, Algorithms 2–3, eqs. 17/58).

The affine (α, β) of a pretrained norm is merged into every Linear that consumes its output
(W̃ = W·diag(α), b̃ = W·β + b, eq. 58), so the norm itself has no parameters. Its forward returns
z = σ⁻¹·H·x (LayerNorm) or z = σ⁻¹·x (RMSNorm) and saves z and one fp32 σ⁻¹ per row. The next Linear
saves the same z for its weight gradient, so the two layers share one tensor (Proposition 5.1).
Backward (Algorithms 2–3): dx = σ⁻¹·(dz − mean(dz) − z·mean(dz·z)) for LayerNorm and
dx = σ⁻¹·(dz − z·mean(dz·z)) for RMSNorm, per row over the last dimension.
Pure PyTorch (CPU and CUDA); a fused Triton version is future work.
"""

from __future__ import annotations

import torch
from torch import nn


class _MSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps: float, center: bool):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 math (fp64 stays fp64)
        if center:
            xf = xf - xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        z = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(z, rstd)
        ctx.center = center
        return z

    @staticmethod
    def backward(ctx, dz):
        z, rstd = ctx.saved_tensors
        dzf, zf = dz.to(rstd.dtype), z.to(rstd.dtype)
        dx = dzf - zf * (dzf * zf).mean(-1, keepdim=True)
        if ctx.center:
            dx = dx - dzf.mean(-1, keepdim=True)
        return (dx * rstd).to(dz.dtype), None, None


class MSLayerNorm(nn.Module):
    """LayerNorm without affine whose backward needs only its output and σ⁻¹ (Algorithm 2)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5):
        super().__init__()
        self.normalized_shape, self.eps = int(normalized_shape), float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(f"MSLayerNorm expects last dimension {self.normalized_shape}, got {tuple(x.shape)}")
        return _MSNorm.apply(x, self.eps, True)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class MSRMSNorm(MSLayerNorm):
    """RMSNorm without affine whose backward needs only its output and σ⁻¹ (Algorithm 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(f"MSRMSNorm expects last dimension {self.normalized_shape}, got {tuple(x.shape)}")
        return _MSNorm.apply(x, self.eps, False)


@torch.no_grad()
def merge_norm(norm: nn.LayerNorm | nn.RMSNorm, consumers: list[nn.Linear]) -> MSLayerNorm:
    """Fold the norm's affine into every consumer Linear in place (eq. 58) and return the MS-norm that
    replaces it. Several consumers (e.g. q, k, v) all get merged; the function computed is unchanged."""
    if not consumers:
        raise ValueError("merge_norm needs at least one consumer nn.Linear")
    dim = norm.normalized_shape[-1] if isinstance(norm.normalized_shape, tuple) else norm.normalized_shape
    for lin in consumers:
        if not isinstance(lin, nn.Linear) or lin.in_features != dim:
            raise ValueError(f"consumer {lin} must be an nn.Linear with in_features={dim}")
    alpha = norm.weight if norm.weight is not None else torch.ones(dim)
    beta = getattr(norm, "bias", None)
    for lin in consumers:
        W = lin.weight.double()
        b = lin.bias.double() if lin.bias is not None else torch.zeros(lin.out_features, dtype=torch.float64)
        if beta is not None:
            b = b + W @ beta.double()
            if lin.bias is None:
                lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=lin.weight.dtype))
        lin.weight.copy_((W * alpha.double()).to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_(b.to(lin.bias.dtype))
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    cls = MSLayerNorm if isinstance(norm, nn.LayerNorm) else MSRMSNorm
    return cls(dim, eps)
