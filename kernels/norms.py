"""Memory-sharing LayerNorm and RMSNorm (Approx-BP §5.2, App. G, Algorithms 2–3, eqs. 17/58).

The affine (α, β) of a pretrained norm is merged into every Linear that consumes its output
(W̃ = W·diag(α), b̃ = W·β + b, eq. 58), so the norm itself has no parameters. Its forward returns
z = σ⁻¹·H·x (LayerNorm) or z = σ⁻¹·x (RMSNorm) and saves z and one fp32 σ⁻¹ per row. The next Linear
saves the same z for its weight gradient, so the two layers share one tensor (Proposition 5.1).
Backward (Algorithms 2–3): dx = σ⁻¹·(dz − mean(dz) − z·mean(dz·z)) for LayerNorm and
dx = σ⁻¹·(dz − z·mean(dz·z)) for RMSNorm, per row over the last dimension.
CUDA tensors (or ``use_triton=True``, e.g. under ``TRITON_INTERPRET=1``) run the fused row kernels below;
other tensors run the PyTorch twin. Both reduce in fp32 (fp64 stays fp64); reduction order differs, so
they agree to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from . import ops, swaps
from .guards import check_input, check_triton_device


@triton.jit
def _row_tile(rows, d, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's ROWS row indices, their [ROWS, BLOCK_D] offsets and the in-bounds mask."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK_D)
    return r, r[:, None] * d + c[None, :], (r[:, None] < rows) & (c[None, :] < d)


@triton.jit
def _ms_norm_forward(x_ptr, z_ptr, rstd_ptr, rows, d, eps, CENTER: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    r, offs, mask = _row_tile(rows, d, ROWS, BLOCK_D)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    if CENTER:  # shifted by the row's first element first: a constant row centres to exactly 0 at any magnitude
        x = tl.where(mask, x - tl.load(x_ptr + r * d, mask=r < rows, other=0.0).to(x.dtype)[:, None], 0.0)
        x = tl.where(mask, x - tl.sum(x, axis=1)[:, None] / d, 0.0)
    var = tl.sum(x * x, axis=1) / d
    rstd = 1.0 / tl.sqrt(var + eps)
    if CENTER:  # an overflowing variance gives NaN, as torch's LayerNorm does (its RMSNorm gives 0, as here)
        rstd = tl.where(var == float("inf"), float("nan"), rstd)
    tl.store(z_ptr + offs, (x * rstd[:, None]).to(z_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(rstd_ptr + r, rstd, mask=r < rows)


@triton.jit
def _ms_norm_backward(dz_ptr, z_ptr, rstd_ptr, dx_ptr, rows, d, CENTER: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    r, offs, mask = _row_tile(rows, d, ROWS, BLOCK_D)
    rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)
    dz = tl.load(dz_ptr + offs, mask=mask, other=0.0).to(rstd.dtype)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(rstd.dtype)
    dx = dz - z * (tl.sum(dz * z, axis=1) / d)[:, None]
    if CENTER:
        dx = dx - (tl.sum(dz, axis=1) / d)[:, None]
    tl.store(dx_ptr + offs, (dx * rstd[:, None]).to(dx_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)


def _launch_shape(d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(max(d, 1))
    return max(1, min(64, 4096 // block_d)), block_d


def ms_norm_forward_impl(x, eps: float, center: bool, use_triton: bool, out_dtype):
    """(z, σ⁻¹): z = σ⁻¹·H·x (LayerNorm) or σ⁻¹·x (RMSNorm) in ``out_dtype`` (default x's), σ⁻¹ per row in fp32
    (fp64 for fp64 input)."""
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
    out_dtype = out_dtype or x.dtype
    if use_triton:
        check_triton_device(x)
        d = x.shape[-1]
        xc = x.reshape(-1, d).contiguous()
        z = torch.empty(xc.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(xc.shape[0], 1, dtype=acc, device=x.device)
        rows_per, block_d = _launch_shape(d)
        if xc.numel():
            _ms_norm_forward[(triton.cdiv(xc.shape[0], rows_per),)](
                xc, z, rstd, xc.shape[0], d, eps, CENTER=center, ROWS=rows_per, BLOCK_D=block_d)
        return z.view(x.shape), rstd.view(*x.shape[:-1], 1)
    xf = x.to(acc)
    if center:  # shifted by the row's first element first (as the kernel): a constant row centres to exactly 0
        xf = xf - xf[..., :1]
        xf = xf - xf.mean(-1, keepdim=True)
    var = xf.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    if center:  # an overflowing variance gives NaN, as torch's LayerNorm does (its RMSNorm gives 0, as here)
        rstd = torch.where(torch.isinf(var), float("nan"), rstd)
    return (xf * rstd).to(out_dtype), rstd


def ms_norm_backward_impl(dz, z, rstd, center: bool, use_triton: bool, dtype):
    """dx (Algorithms 2–3) in ``dtype`` (the input's) from dz, z and σ⁻¹."""
    if use_triton:
        d = z.shape[-1]
        dzc = dz.reshape(-1, d).contiguous()
        dx = torch.empty(dzc.shape, dtype=dtype, device=dz.device)
        rows_per, block_d = _launch_shape(d)
        if dzc.numel():
            _ms_norm_backward[(triton.cdiv(dzc.shape[0], rows_per),)](
                dzc, z.reshape(-1, d).contiguous(), rstd.reshape(-1), dx, dzc.shape[0], d, CENTER=center,
                ROWS=rows_per, BLOCK_D=block_d)
        return dx.view(dz.shape)
    dzf, zf = dz.to(rstd.dtype), z.to(rstd.dtype)
    dx = dzf - zf * (dzf * zf).mean(-1, keepdim=True)
    if center:
        dx = dx - dzf.mean(-1, keepdim=True)
    return (dx * rstd).to(dtype)


def ms_norm(x: torch.Tensor, eps: float, center: bool, use_triton: bool | None = None) -> torch.Tensor:
    """The MS-norm (an autograd.Function in eager mode, ``approxbp::ms_norm_forward`` under dynamo); saves z (the
    output, shared with the next Linear) and σ⁻¹. Under autocast z is returned in the autocast dtype
    (ops.autocast_dtype): the consumer Linear would cast it anyway and save its own copy, so sharing needs z in
    that dtype."""
    check_input(x, "MSLayerNorm" if center else "MSRMSNorm")
    return ops.ms_norm(x, eps, center, x.is_cuda if use_triton is None else use_triton, ops.autocast_dtype(x))


def _eps(eps: float | None, x: torch.Tensor) -> float:
    return eps if eps is not None else float(torch.finfo(x.dtype).eps)


class MSLayerNorm(nn.Module):
    """LayerNorm without affine whose backward needs only its output and σ⁻¹ (Algorithm 2)."""

    def __init__(self, normalized_shape: int, eps: float | None = 1e-5, use_triton: bool | None = None):
        super().__init__()
        # eps=None: the input dtype's machine epsilon at each call, as nn.RMSNorm(eps=None) does
        self.normalized_shape, self.use_triton = int(normalized_shape), use_triton
        self.eps = None if eps is None else float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(f"MSLayerNorm expects last dimension {self.normalized_shape}, got {tuple(x.shape)}")
        return ms_norm(x, _eps(self.eps, x), True, self.use_triton)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class MSRMSNorm(MSLayerNorm):
    """RMSNorm without affine whose backward needs only its output and σ⁻¹ (Algorithm 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(f"MSRMSNorm expects last dimension {self.normalized_shape}, got {tuple(x.shape)}")
        return ms_norm(x, _eps(self.eps, x), False, self.use_triton)


class AffineInputLinear(nn.Linear):
    """A trainable adapter Linear (LoRA's ``lora_A``) that reads a merged norm's output z and computes
    Linear(α⊙z + β) = z·(W·diag α)ᵀ + (W·β + b), with the norm's frozen α, β as non-persistent buffers. Its weight,
    its gradient and its state-dict keys are those of the original Linear. It saves z itself (shared with the
    MS-norm) and the small r×d product W·diag α, never α⊙z + β; plain ops, so no Python in the backward and
    nothing for dynamo to break on."""

    def __init__(self, linear: nn.Linear, alpha: torch.Tensor, beta: torch.Tensor | None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: the optimiser sees no change
        self.register_buffer("alpha", alpha.detach().clone(), persistent=False)
        self.register_buffer("beta", None if beta is None else beta.detach().clone(), persistent=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.beta is None else self.weight @ self.beta.to(self.weight.dtype) + (
            0.0 if self.bias is None else self.bias)
        return nn.functional.linear(z, self.weight * self.alpha.to(self.weight.dtype), bias)


class _NormInputLinearFn(torch.autograd.Function):
    """y = (α⊙z + β)·Wᵀ + b from the MS-norm's output z (W is (out, in); Conv1D passes Wᵀ's view). Saves z (the
    tensor the MS-norm saves anyway) and references to W, α, β (parameters: no copies); u = α⊙z + β is recomputed
    in the backward. Gradients are exact: dz = (dy·W)⊙α, dW = dyᵀ·u, db = Σ dy, dα = Σ (dy·W)⊙z, dβ = Σ dy·W."""

    @staticmethod
    def _input(z, alpha, beta):
        """u = α⊙z + β in z's dtype (α or β may be absent)."""
        u = z * alpha.to(z.dtype) if alpha is not None else z
        return u + beta.to(z.dtype) if beta is not None else u

    @staticmethod
    def forward(ctx, z, weight, bias, alpha, beta):
        ctx.save_for_backward(z, weight, alpha, beta)
        ctx.has_bias = bias is not None
        return nn.functional.linear(_NormInputLinearFn._input(z, alpha, beta), weight, bias)

    @staticmethod
    def backward(ctx, dy):  # in dy's dtype (autocast's, when the forward's Linear ran under it)
        z, weight, alpha, beta = ctx.saved_tensors
        need_z, need_w, need_b, need_a, need_beta = ctx.needs_input_grad
        du = dy.matmul(weight.to(dy.dtype))  # dL/du
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        dz = (du * alpha.to(du.dtype) if alpha is not None else du).to(z.dtype) if need_z else None
        dw = db = da = dbeta = None
        if need_w:  # u recomputed, never saved
            dw = rows(dy).t().matmul(rows(_NormInputLinearFn._input(z, alpha, beta)).to(dy.dtype)).to(weight.dtype)
        if need_b and ctx.has_bias:
            db = rows(dy).sum(0).to(weight.dtype)
        if need_a and alpha is not None:
            da = (rows(du) * rows(z).to(du.dtype)).sum(0).to(alpha.dtype)
        if need_beta and beta is not None:
            dbeta = rows(du).sum(0).to(beta.dtype)
        return dz, dw, db, da, dbeta


class NormInputLinear(nn.Linear):
    """A consumer Linear (or Hugging Face ``Conv1D``) of a norm whose affine α, β stay the model's own parameters:
    it reads the MS-norm's z and computes Linear(α⊙z + β) exactly, saving only z (shared with the MS-norm).
    Weight, bias and their state-dict keys are the original module's; α, β are read from the norm at every call,
    so they train as in the stock model (:class:`_NormInputLinearFn`)."""

    def __init__(self, linear: nn.Module, norm: nn.Module):
        nn.Module.__init__(self)
        self.transposed = type(linear).__name__ == "Conv1D"  # weight (in, out): y = x·W + b
        self.in_features, self.out_features = ((linear.weight.shape[0], linear.weight.shape[1]) if self.transposed
                                               else (linear.in_features, linear.out_features))
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: the optimiser sees no change
        self.__dict__["norm"] = norm  # not a submodule: α, β keep their own (single) state-dict keys

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        norm = self.__dict__["norm"]
        weight = self.weight.t() if self.transposed else self.weight
        return _NormInputLinearFn.apply(z, weight, self.bias, norm.weight, getattr(norm, "bias", None))

    def extra_repr(self) -> str:
        return super().extra_repr() + (", Conv1D" if self.transposed else "") + ", input α⊙z + β"


# Hugging Face RMSNorms whose forward is weight · x/rms(x) (not Gemma's (1 + weight)); matched by class name so
# that transformers stays optional
HF_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}


def norm_dim_eps(norm: nn.Module) -> tuple[int, float]:
    """(the normalised size, eps) of a mergeable norm; refuses norms over several trailing dimensions."""
    if isinstance(norm, nn.LayerNorm | nn.RMSNorm):
        shape = tuple(norm.normalized_shape) if isinstance(norm.normalized_shape, tuple | list) else (
            norm.normalized_shape,)
        if len(shape) != 1:
            raise ValueError(f"MS-norms normalise over the last dimension only; {norm} normalises over {shape}")
        dim, eps = shape[0], norm.eps
    else:
        dim, eps = norm.weight.shape[-1], getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return dim, eps


def keep_affine(norm: nn.Module, consumers: list[nn.Module]) -> tuple[MSLayerNorm, list[NormInputLinear]]:
    """The non-reparameterising MS-norm (the default for trainable models): the norm becomes an MS-norm that
    returns z and holds the norm's own α (``weight``) and β (``bias``) Parameters under their stock names, and
    every consumer becomes a :class:`NormInputLinear` that applies them. The function computed, every gradient
    and the state dict are the stock model's; z is saved once for the norm and all its consumers."""
    if not is_mergeable_norm(norm):
        raise TypeError(f"keep_affine handles nn.LayerNorm, nn.RMSNorm and {sorted(HF_RMS_NORMS)}, got {type(norm)}")
    dim, eps = norm_dim_eps(norm)
    ms = (MSLayerNorm if isinstance(norm, nn.LayerNorm) else MSRMSNorm)(dim, eps)
    wrapped = [NormInputLinear(c, ms) for c in consumers]
    for c, w in zip(consumers, wrapped):
        if w.in_features != dim:
            raise ValueError(f"consumer {c} must read {dim} features")
        swaps.mark_replaced(w, c)
    ms.weight = norm.weight  # Parameters (or None): the same objects, the same state-dict keys
    if hasattr(norm, "bias"):
        ms.bias = norm.bias
    swaps.mark_replaced(ms, norm)  # for unpatch: no arithmetic to undo
    swaps.mark_kept_affine(ms)
    return ms, wrapped


def is_mergeable_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__ in HF_RMS_NORMS


@torch.no_grad()
def merge_norm(norm: nn.Module, consumers: list[nn.Linear]) -> MSLayerNorm:
    """Fold the norm's affine into every consumer Linear in place (eq. 58) and return the MS-norm that
    replaces it. Several consumers (e.g. q, k, v) all get merged; the function computed is unchanged.
    Accepts nn.LayerNorm, nn.RMSNorm and the Hugging Face RMSNorms in ``HF_RMS_NORMS``."""
    if not consumers:
        raise ValueError("merge_norm needs at least one consumer nn.Linear")
    if not is_mergeable_norm(norm):
        raise TypeError(f"merge_norm handles nn.LayerNorm, nn.RMSNorm and {sorted(HF_RMS_NORMS)}, got {type(norm)}")
    dim, eps = norm_dim_eps(norm)
    for lin in consumers:
        if not isinstance(lin, nn.Linear) or lin.in_features != dim:
            raise ValueError(f"consumer {lin} must be an nn.Linear with in_features={dim}")
    alpha = norm.weight if norm.weight is not None else torch.ones(dim)
    beta = getattr(norm, "bias", None)
    merged = []  # everything is computed before anything is written: an error leaves the consumers untouched
    for lin in consumers:
        W = lin.weight.double()
        b = lin.bias.double() if lin.bias is not None else torch.zeros(lin.out_features, dtype=torch.float64)
        if beta is not None:
            b = b + W @ beta.to(W.device, torch.float64)
        merged.append((lin, (W * alpha.to(W.device, torch.float64)).to(lin.weight.dtype),
                       b.to(lin.weight.dtype) if (beta is not None or lin.bias is not None) else None))
    created = [lin.bias is None and b is not None for lin, _, b in merged]
    for lin, W, b in merged:
        lin.weight.copy_(W)
        if b is not None and lin.bias is None:
            lin.bias = nn.Parameter(b, requires_grad=lin.weight.requires_grad)
        elif b is not None:
            lin.bias.copy_(b.to(lin.bias.dtype))
    cls = MSLayerNorm if isinstance(norm, nn.LayerNorm) else MSRMSNorm
    ms = cls(dim, eps)
    # what unmerge_norm needs (kept outside the module tree: no parameters, no state-dict keys)
    swaps.mark_merged(ms, norm, [m for m, _, _ in merged], created)
    ms._register_state_dict_hook(_warn_merged_layout)
    return ms


def _warn_merged_layout(module, state_dict, prefix, local_metadata) -> None:
    """Saving a model whose norms are merged gives a state dict the stock class cannot load as it was trained."""
    import warnings

    warnings.warn(f"{prefix or 'a '}norm is merged into its frozen consumers (eq. 58): this state dict is not the "
                  "stock layout (norm weights missing, consumer weights scaled); save "
                  "approxbp.kernels.patched_state_dict(model), or unpatch(model) first", UserWarning, stacklevel=3)


@torch.no_grad()
def unmerge_norm(ms: MSLayerNorm) -> nn.Module:
    """Undo :func:`merge_norm`: W = W̃·diag(α)⁻¹ and b = b̃ − W·β in every consumer (float64), and return the
    original norm module. Raises if α has zeros (the merged columns carry no information then)."""
    if swaps.merged(ms) is None:
        raise ValueError(f"{ms} was not made by merge_norm")
    norm, consumers, created = swaps.merged(ms)
    alpha = norm.weight.double() if norm.weight is not None else None
    if alpha is not None and bool((alpha == 0).any()):
        raise ValueError("cannot unmerge: the norm's weight α has zeros")
    beta = getattr(norm, "bias", None)
    for lin, made in zip(consumers, created):
        W = lin.weight.double() / (alpha.to(lin.weight.device) if alpha is not None else 1.0)
        if made:
            lin.bias = None
        elif lin.bias is not None and beta is not None:
            lin.bias.copy_((lin.bias.double() - W @ beta.double().to(W.device)).to(lin.bias.dtype))
        lin.weight.copy_(W.to(lin.weight.dtype))
    return norm
