"""Inverted activations for training (Inverted Activations §2, Listing 2): y = f(x) exactly; saved for
backward are y itself (the tensor the next layer saves anyway) and a 1-bit branch flag s = [x < T],
packed 8 per byte little-end-first; backward returns dy · q_s(y) from an invact table. A monotone table
(softplus, squareplus: one branch) saves y alone.

CUDA tensors (or ``use_triton=True``, e.g. on the CPU under ``TRITON_INTERPRET=1``) run the module that
``approxbp export`` generated from the table; other tensors run the pure-PyTorch twin below.

Every finite input has a finite gradient: beyond the table's right domain (y > RIGHT_MAX = f(T) + 10) the
backward uses q = h′(y), because f⁻¹(y) − y vanishes exponentially for the ReLU-like activations this family
serves (``fit_invact`` refuses an activation where that tail rule errs by more than 1e-6). NaN in gives NaN out.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
from approxbp.approximations import tables as table_files
from torch import Tensor

from . import custom_ops
from .guards import check_input, check_triton_device
from .launch import BIT_BLOCK_BYTES, ELEMENT_BLOCK, num_warps
from .modules import GeneratedSpec, spec_of
from .packing import byte_codes, pack, unpack_into
from .stock import exact_forward

__all__ = ["dispatch", "INVACT", "invact", "invact_forward", "InvActFunction", "InvActGELU", "InvActivation",
           "InvActSiLU", "InvActSpec"]


class InvActSpec(GeneratedSpec):
    """Constants and the two branch approximations of one invact table, read from its generated module (the
    Triton kernels and the PyTorch twin of the backward rule)."""

    family = "invact"
    plan_options = {"invact": 1}  # one option: the packaged fast form (one branch bit)

    @staticmethod
    def packaged(activation: str, bits: int) -> str:
        return f"invact/{activation}-fast"

    def error_said(self) -> str:
        """The table's stored L∞ (certified where ``approxbp certify`` ran)."""
        from approxbp.approximations.gradient_error import describe, invact_error

        return describe(self.family, invact_error(table_files.stored_metrics(self.path)))

    def __init__(self, table: str | Path | dict, kernels_dir: str | Path | None = None):
        super().__init__(table, kernels_dir)
        self.turning_point, self.f_T = self.module.TURNING_POINT, self.module.F_T
        #: an increasing activation: one branch, so no bit is saved (the "bits" tensor is empty)
        self.monotone = getattr(self.module, "MONOTONE", False)

    def bit_bytes(self, n: int) -> int:
        """Bytes of branch bits saved for ``n`` elements: one bit each, none for a monotone table."""
        return 0 if self.monotone else (n + 7) // 8

    def forward_torch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.monotone:
            bits = x.new_empty((0,), dtype=torch.uint8)
        else:  # the branch compared in fp32 (fp64 stays fp64), as the kernels compare
            bits = pack(x.to(torch.promote_types(x.dtype, torch.float32)) < self.turning_point, 1)
        return exact_forward(self.module, x), bits

    def q(self, y: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """q_s(y) for saved outputs ``y`` and branch flags ``left`` (True where x < T): the backward rule
        (approximations.invact_forms.backward_rule) in float32 (float64 stays float64)."""
        y = y.to(torch.promote_types(y.dtype, torch.float32))
        return self.module.backward_rule_twin(y, left.to(y.dtype))

    def backward_torch(self, g: torch.Tensor, y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        left = (torch.zeros((), dtype=torch.bool, device=y.device) if self.monotone else
                unpack_into(packed, byte_codes(1, y.device, torch.bool), y.numel()).view(y.shape))
        q = self.q(y, left)
        if not q.is_floating_point():  # a q of integer constants (ReLU6's select(y, select(6 − y, 1, 0), 0))
            q = q.to(torch.promote_types(y.dtype, torch.float32))
        return (g.to(q.dtype) * q).to(g.dtype)

    # -- the generated Triton kernels ----------------------------------------------------------
    def forward_triton(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_triton_device(x)
        xc = x.contiguous()
        y = torch.empty_like(xc)
        packed = torch.empty(self.bit_bytes(xc.numel()), dtype=torch.uint8, device=x.device)
        if xc.numel() and self.monotone:
            self.module.forward_kernel[(triton.cdiv(xc.numel(), ELEMENT_BLOCK),)](
                xc, y, xc.numel(), BLOCK=ELEMENT_BLOCK, num_warps=num_warps(x.dtype))
        elif xc.numel():
            grid = (triton.cdiv(packed.numel(), BIT_BLOCK_BYTES),)
            self.module.forward_kernel[grid](xc, y, packed, xc.numel(), packed.numel(), BLOCK=BIT_BLOCK_BYTES,
                                             num_warps=num_warps(x.dtype))
        return y, packed

    def backward_triton(self, g: torch.Tensor, y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        gc, yc = g.contiguous(), y.contiguous()
        out = torch.empty_like(gc)
        if gc.numel() and self.monotone:
            self.module.backward_kernel[(triton.cdiv(gc.numel(), ELEMENT_BLOCK),)](
                gc, yc, out, gc.numel(), BLOCK=ELEMENT_BLOCK, num_warps=num_warps(g.dtype))
        elif gc.numel():
            grid = (triton.cdiv(packed.numel(), BIT_BLOCK_BYTES),)
            self.module.backward_kernel[grid](gc, yc, packed, out, gc.numel(), packed.numel(), BLOCK=BIT_BLOCK_BYTES,
                                              num_warps=num_warps(g.dtype))
        return out


# ---- the op (custom_ops.Op): custom ops under dynamo, an eager Function otherwise ---------------------------------
def _forward(x: Tensor, key: str, use_triton: bool, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """y = f(x) in ``out_dtype`` (None: x's) and the packed branch bits."""
    spec = spec_of(key)
    y, bits = (spec.forward_triton if use_triton else spec.forward_torch)(x)
    y = custom_ops.laid_out_like(y.view(x.shape), x)
    return (y if out_dtype is None else y.to(out_dtype)), bits


def _backward(g: Tensor, y: Tensor, bits: Tensor, key: str, use_triton: bool, dtype: torch.dtype) -> Tensor:
    """dx = dy · q_s(y) in ``dtype`` (the input's)."""
    spec = spec_of(key)
    g = g.to(dtype)
    backward = spec.backward_triton if use_triton else spec.backward_torch
    return custom_ops.laid_out_like(backward(g, y, bits).view(g.shape), g)


def _forward_fake(x, key, use_triton, out_dtype):
    return (torch.empty_like(x, dtype=out_dtype or x.dtype),
            x.new_empty((spec_of(key).bit_bytes(x.numel()),), dtype=torch.uint8))


INVACT = custom_ops.Op("invact", _forward, _backward, saves=lambda inputs, out: out,
                       options=lambda x, key, use_triton, out_dtype: (key, use_triton, x.dtype),
                       fakes=(_forward_fake,
                              lambda g, y, bits, key, use_triton, dtype: torch.empty_like(g, dtype=dtype)),
                       function_name="InvActFunction")
invact_forward, InvActFunction = INVACT.forward_op, INVACT.function


def dispatch(x: Tensor, spec: InvActSpec, use_triton: bool, out_dtype: torch.dtype | None) -> Tensor:
    """y = f(x) in ``out_dtype`` (default x's); saves y and one branch bit per element (:data:`INVACT`); without
    grad, the twin's plain forward."""
    if not (use_triton or custom_ops.needs_grad(x) or custom_ops.opaque()):
        y = spec.forward_only_torch(x)
        return y if out_dtype is None else y.to(out_dtype)
    return INVACT(x, spec.key, use_triton, out_dtype)[0]


def invact(x: torch.Tensor, spec: InvActSpec, use_triton: bool | None = None) -> torch.Tensor:
    """y = f(x) exactly; saves y and one branch bit per element; dx = dy · q_s(y) (:func:`dispatch` on a checked
    input). Under autocast a wider input gives y in the autocast dtype (custom_ops.autocast_dtype), so that the next
    Linear saves the same tensor."""
    check_input(x, "InvActivation")
    return dispatch(x, spec, x.is_cuda if use_triton is None else use_triton, custom_ops.autocast_dtype(x))


class InvActivation(torch.nn.Module):
    """Drop-in activation that saves its output and 1 bit per element (any invact table)."""

    def __init__(self, table: str | Path | dict, use_triton: bool | None = None,
                 kernels_dir: str | Path | None = None):
        """``kernels_dir``: where the generated Triton module lives (``approxbp export --out-dir``); None: the
        package for packaged tables, ``<table folder>/_generated/`` for yours."""
        super().__init__()
        self.spec = custom_ops.checked_and_registered(InvActSpec(table, kernels_dir), use_triton)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invact(x, self.spec, self.use_triton)

    def extra_repr(self) -> str:
        return f"table={self.spec.name()}"


class InvActGELU(InvActivation):
    """GELU that saves its output + 1 bit; backward by our `fast` form (L∞ ≤ 1e-6, one √ and one log per
    element); ``form='newton'`` for the accuracy reference, ``form='paper'`` for eqs. 5–6."""

    def __init__(self, form: str = "fast", use_triton: bool | None = None):
        super().__init__(f"gelu-{form}", use_triton)


class InvActSiLU(InvActivation):
    """SiLU that saves its output + 1 bit; backward by our `fast` form (``form='newton'``: the accuracy
    reference, ``form='paper'``: eqs. 7–8)."""

    def __init__(self, form: str = "fast", use_triton: bool | None = None):
        super().__init__(f"silu-{form}", use_triton)


InvActSpec.drop_in = InvActivation
