"""The toy family at run time: its spec (read from the generated module), its op (a custom op under dynamo, an
eager Function otherwise, from one ``custom_ops.Op``) and its drop-in module. Saves one byte [x < 0] per element."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
import triton
from approxbp.kernels.ops import custom_ops
from approxbp.kernels.ops.guards import check_input, check_triton_device
from approxbp.kernels.ops.modules import GeneratedSpec, spec_of
from torch import Tensor

FAMILY = "toy-step"
BLOCK = 1024


class ToyStepSpec(GeneratedSpec):
    family = FAMILY
    plan_options = {"toy-step": 8}  # one option: the saved byte per element
    #: where the family's tables live (a package ships them; the test points it at its own folder)
    tables: ClassVar[Path | None] = None

    @classmethod
    def packaged(cls, activation: str, bits: int) -> str:
        return str(cls.tables / f"{activation}-step.json")

    def error_said(self) -> str:
        from approxbp.approximations.gradient_error import describe, gradient_error

        return describe(self.family, gradient_error(self.table))

    def __init__(self, table, kernels_dir=None):
        super().__init__(table, kernels_dir)
        self.levels = self.module.LEVELS

    def forward_torch(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.forward_only_torch(x), (x < 0).view(torch.uint8)

    def backward_torch(self, g: Tensor, s: Tensor) -> Tensor:
        a, b = self.levels
        return (g.float() * torch.where(s.view(torch.bool), a, b)).to(g.dtype)

    def forward_triton(self, x: Tensor) -> tuple[Tensor, Tensor]:
        check_triton_device(x)
        xc = x.contiguous()
        y, s = torch.empty_like(xc), torch.empty(xc.shape, dtype=torch.uint8, device=x.device)
        if xc.numel():
            self.module.forward_kernel[(triton.cdiv(xc.numel(), BLOCK),)](xc, y, s, xc.numel(), BLOCK=BLOCK)
        return y, s

    def backward_triton(self, g: Tensor, s: Tensor) -> Tensor:
        gc = g.contiguous()
        out = torch.empty_like(gc)
        if gc.numel():
            self.module.backward_kernel[(triton.cdiv(gc.numel(), BLOCK),)](gc, s, out, gc.numel(), BLOCK=BLOCK)
        return out


def _forward(x: Tensor, key: str, use_triton: bool) -> tuple[Tensor, Tensor]:
    """y = h(x) and s = [x < 0], one byte per element."""
    spec = spec_of(key)
    y, s = (spec.forward_triton if use_triton else spec.forward_torch)(x)
    return custom_ops.laid_out_like(y.view(x.shape), x), s.reshape(x.shape)


def _backward(g: Tensor, s: Tensor, key: str, use_triton: bool) -> Tensor:
    """dx = dy · (a if s else b)."""
    spec = spec_of(key)
    return custom_ops.laid_out_like((spec.backward_triton if use_triton else spec.backward_torch)(g, s), g)


def _forward_fake(x, key, use_triton):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.uint8)


TOY_STEP = custom_ops.Op("toy_step", _forward, _backward, saves=lambda inputs, out: out[1:],
                         options=lambda x, key, use_triton: (key, use_triton),
                         fakes=(_forward_fake, lambda g, s, key, use_triton: torch.empty_like(g)),
                         function_name="ToyStepFunction")


class ToyStepActivation(torch.nn.Module):
    """Drop-in activation: the exact forward, the toy table's two-level backward."""

    def __init__(self, table, use_triton: bool | None = None, kernels_dir=None):
        super().__init__()
        self.spec = custom_ops.checked_and_registered(ToyStepSpec(table, kernels_dir), use_triton)
        self.use_triton = use_triton

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, "ToyStepActivation")
        use_triton = x.is_cuda if self.use_triton is None else self.use_triton
        if not (use_triton or custom_ops.needs_grad(x) or custom_ops.opaque()):
            return self.spec.forward_only_torch(x)
        return TOY_STEP(x, self.spec.key, use_triton)[0]


ToyStepSpec.drop_in = ToyStepActivation
