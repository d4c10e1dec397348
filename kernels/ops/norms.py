"""Memory-sharing LayerNorm and RMSNorm (Approx-BP §5.2, App. G, Algorithms 2–3, eqs. 17/58).

The affine (α, β) of a pretrained norm is merged into every Linear that consumes its output
(W̃ = W·diag(α), b̃ = W·β + b, eq. 58), so the norm itself has no parameters. Its forward returns
z = σ⁻¹·H·x (LayerNorm) or z = σ⁻¹·x (RMSNorm) and saves z and one fp32 σ⁻¹ per row. The next Linear
saves the same z for its weight gradient, so the two layers share one tensor (Proposition 5.1).
Backward (Algorithms 2–3): dx = σ⁻¹·(dz − mean(dz) − z·mean(dz·z)) for LayerNorm and
dx = σ⁻¹·(dz − z·mean(dz·z)) for RMSNorm, per row over the last dimension.
CUDA tensors (or ``use_triton=True``, e.g. under ``TRITON_INTERPRET=1``) run the fused row kernels below;
other tensors run the PyTorch twin, whose z is torch's own ``layer_norm`` / ``rms_norm`` without affine (bit for bit
the stock value, NaN pattern and layout included). Both reduce in fp32 (fp64 stays fp64); the kernels' reduction
order differs, so they agree with the twin to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from . import custom_ops
from .guards import check_input, check_triton_device

__all__ = ["dispatch", "MS_NORM", "ms_norm", "ms_norm_backward", "ms_norm_backward_impl", "ms_norm_forward",
           "ms_norm_forward_impl", "MSLayerNorm", "MSNormFunction", "MSRMSNorm"]


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


def _torch_norm(x, eps: float, center: bool):
    """torch's own LayerNorm / RMSNorm of x without affine (its value, NaN pattern and layout)."""
    shape = (x.shape[-1],)
    return nn.functional.layer_norm(x, shape, eps=eps) if center else nn.functional.rms_norm(x, shape, eps=eps)


def _z_strides(x, center: bool) -> tuple[int, ...]:
    """The strides torch's norm gives its output (without running a meta kernel, whose Python decomposition would
    import sympy at run time): contiguous for layer_norm; rms_norm keeps a channels-last input's format."""
    fmt = torch.contiguous_format
    if not center and not x.is_contiguous():
        for kind, dims in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
            if x.dim() == dims and x.is_contiguous(memory_format=kind):
                fmt = kind
    return torch.empty_like(x, device="meta", memory_format=fmt).stride()


def ms_norm_forward_impl(x: Tensor, eps: float, center: bool, use_triton: bool,
                         out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """(z, σ⁻¹): z = σ⁻¹·H·x (LayerNorm) or σ⁻¹·x (RMSNorm) in ``out_dtype`` (default x's), σ⁻¹ per row in fp32
    (fp64 for fp64 input)."""
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
    out_dtype = out_dtype or x.dtype
    if use_triton and x.shape[-1]:  # (a zero-width row has nothing to launch: the twin's empty result)
        check_triton_device(x)
        d = x.shape[-1]
        xc = x.reshape(-1, d).contiguous()
        z = torch.empty(xc.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(xc.shape[0], 1, dtype=acc, device=x.device)
        rows_per, block_d = _launch_shape(d)
        if xc.numel():
            _ms_norm_forward[(triton.cdiv(xc.shape[0], rows_per),)](
                xc, z, rstd, xc.shape[0], d, eps, CENTER=center, ROWS=rows_per, BLOCK_D=block_d)
        return custom_ops.laid_out(z.view(x.shape), _z_strides(x, center)), rstd.view(*x.shape[:-1], 1)
    # z by torch's own op (its rounding, NaN/Inf pattern and layout: what nn.LayerNorm / nn.RMSNorm return without
    # an affine); σ⁻¹, which only the backward reads, in fp32 (torch's LayerNorm keeps it in fp16 for fp16 input)
    z = _torch_norm(x, eps, center)
    xf = x.to(acc)
    if center:  # σ⁻¹ from the row shifted by its first element first (as the kernel): a constant row's variance is 0
        xf = xf - xf[..., :1]
        xf = xf - xf.mean(-1, keepdim=True)
    var = xf.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    if center:  # an overflowing variance gives NaN, as torch's LayerNorm does (its RMSNorm gives 0, as here)
        rstd = torch.where(torch.isinf(var), float("nan"), rstd)
    return z.to(out_dtype), rstd


def ms_norm_backward_impl(dz: Tensor, z: Tensor, rstd: Tensor, center: bool, use_triton: bool,
                          dtype: torch.dtype) -> Tensor:
    """dx (Algorithms 2–3) in ``dtype`` (the input's) from dz, z and σ⁻¹."""
    if use_triton and z.shape[-1]:
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
    return (dx * rstd).to(dtype).contiguous()  # laid out as the fake declares


# ---- the op (custom_ops.Op): custom ops under dynamo, an eager Function otherwise ---------------------------------
def _forward_fake(x, eps, center, use_triton, out_dtype):
    acc = torch.promote_types(x.dtype, torch.float32)
    return _torch_norm(x, eps, center).to(out_dtype or x.dtype), x.new_empty((*x.shape[:-1], 1), dtype=acc)


MS_NORM = custom_ops.Op(
    "ms_norm", ms_norm_forward_impl, ms_norm_backward_impl, saves=lambda inputs, out: out,
    options=lambda x, eps, center, use_triton, out_dtype: (center, use_triton, x.dtype),
    fakes=(_forward_fake, lambda dz, z, rstd, center, use_triton, dtype:
           torch.empty_like(dz, dtype=dtype, memory_format=torch.contiguous_format)),
    function_name="MSNormFunction")
ms_norm_forward, ms_norm_backward, MSNormFunction = MS_NORM.forward_op, MS_NORM.backward_op, MS_NORM.function


def dispatch(x: Tensor, eps: float, center: bool, use_triton: bool, out_dtype: torch.dtype | None) -> Tensor:
    """z = σ⁻¹·H·x (``center``) or σ⁻¹·x; saves z and σ⁻¹ (:data:`MS_NORM`)."""
    return MS_NORM(x, eps, center, use_triton, out_dtype)[0]


def ms_norm(x: torch.Tensor, eps: float, center: bool, use_triton: bool | None = None) -> torch.Tensor:
    """The MS-norm (:func:`dispatch` on a checked input); saves z (the output, shared with the next Linear) and σ⁻¹.
    Under autocast z is returned in the autocast dtype (custom_ops.autocast_dtype): the consumer Linear would cast it
    anyway and save its own copy, so sharing needs z in that dtype."""
    check_input(x, "MSLayerNorm" if center else "MSRMSNorm")
    return dispatch(x, eps, center, x.is_cuda if use_triton is None else use_triton, custom_ops.autocast_dtype(x))


def _eps(eps: float | None, x: torch.Tensor) -> float:
    """eps, or for None the machine epsilon of the dtype the norm computes in, as torch's rms_norm: fp32's for
    fp16/bf16 input (1.2e-7, not bf16's 7.8e-3, which turned a row of 0.05 into 0.996, not 1), fp64's for fp64."""
    return eps if eps is not None else float(torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps)


class MSLayerNorm(nn.Module):
    """LayerNorm without affine whose backward needs only its output and σ⁻¹ (Algorithm 2)."""

    center = True  # σ⁻¹·H·x (LayerNorm); MSRMSNorm: σ⁻¹·x
    def __init__(self, normalized_shape: int, eps: float | None = 1e-5, use_triton: bool | None = None):
        super().__init__()
        # eps=None: at each call the machine epsilon of the dtype it computes in, as nn.RMSNorm(eps=None) does
        self.normalized_shape, self.use_triton = int(normalized_shape), use_triton
        self.eps = None if eps is None else float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalise(x, custom_ops.autocast_dtype(x))

    def normalise(self, x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
        """z in ``out_dtype`` (None: x's; :func:`ms_norm` explains the autocast policy); saves z and σ⁻¹."""
        if x.dim() == 0 or x.shape[-1] != self.normalized_shape:
            raise ValueError(f"{type(self).__name__} expects last dimension {self.normalized_shape}, got "
                             f"{tuple(x.shape)}" + (" (a 0-dim tensor: no dimension to normalise)" * (x.dim() == 0)))
        check_input(x, type(self).__name__)
        use_triton = x.is_cuda if self.use_triton is None else self.use_triton
        return dispatch(x, _eps(self.eps, x), self.center, use_triton, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class MSRMSNorm(MSLayerNorm):
    """RMSNorm without affine whose backward needs only its output and σ⁻¹ (Algorithm 3)."""

    center = False
