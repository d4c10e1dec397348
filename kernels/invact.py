"""Inverted activations for training (Inverted Activations §2, Listing 2): y = f(x) exactly; saved for
backward are y itself (the tensor the next layer saves anyway) and a 1-bit branch flag s = [x < T],
packed 8 per byte little-end-first; backward returns dy · q_s(y) from an invact table.

Pure PyTorch (the reference path for every device); Triton kernels for this family are future work.
"""

from __future__ import annotations

import torch
from approxbp.approximations import get_activation
from approxbp.approximations import tables as T
from approxbp.approximations.invact_forms import Form

from .relu_sum import pack, unpack


class InvActSpec:
    """Constants and the two branch approximations of one invact table."""

    def __init__(self, table: str):
        t = T.load(table if str(table).endswith(".json") else f"invact/{table}")
        if t["family"] != "invact":
            raise ValueError(f"{table}: expected an invact table, got {t['family']!r}")
        self.table = t
        self.T, self.f_T = t["turning_point"], t["f_T"]
        self.left_max = t["left"]["domain"][1]
        self._f = get_activation(t["expression"]).torch_fn(0)
        self._q = {side: Form.from_table(t[side]).torch_fn() for side in ("left", "right")}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xc = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 math; fp64 stays fp64
        return self._f(xc).to(x.dtype), pack(xc < self.T, 1)

    def backward(self, g: torch.Tensor, y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        left = unpack(packed, 1, y.numel()).view(y.shape).bool()
        yf = y.to(torch.promote_types(y.dtype, torch.float32)).clamp_min(self.f_T)  # rounding may put y below f(T)
        q = torch.where(left, self._q["left"](yf.clamp_max(self.left_max)), self._q["right"](yf))
        return (g.to(q.dtype) * q).to(g.dtype)


class InvActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec: InvActSpec):
        y, packed = spec.forward(x)
        ctx.save_for_backward(y, packed)
        ctx.spec = spec
        return y

    @staticmethod
    def backward(ctx, g):
        y, packed = ctx.saved_tensors
        return ctx.spec.backward(g, y, packed), None


class InvActivation(torch.nn.Module):
    """Drop-in activation that saves its output and 1 bit per element (any invact table)."""

    def __init__(self, table: str):
        super().__init__()
        self.spec = InvActSpec(table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InvActFunction.apply(x, self.spec)

    def extra_repr(self) -> str:
        return f"table={self.spec.table['activation']}-{self.spec.table['form']}"


class InvActGELU(InvActivation):
    """GELU that saves its output + 1 bit; backward by our `newton` form (``form='paper'`` for eqs. 5–6)."""

    def __init__(self, form: str = "newton"):
        super().__init__(f"gelu-{form}")


class InvActSiLU(InvActivation):
    """SiLU that saves its output + 1 bit; backward by our `newton` form (``form='paper'`` for eqs. 7–8)."""

    def __init__(self, form: str = "newton"):
        super().__init__(f"silu-{form}")
