"""torch's own forward for the activations it has an op for: what every drop-in's CPU path returns, so that a
reader sees the stock value bit for bit in the input's dtype (torch computes fp16/bf16 in fp32 and rounds once).
Keyed by the generated module's ``EXPRESSION`` (the table's canonical sympy text; a test checks each key against
the named activation's expression and each op against it in float64). An activation torch has no op for runs the
generated PyTorch twin (fp32 math, fp64 stays fp64). The Triton kernels compute their own formula (within a few
ulp of torch's; measured on a GPU only)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

__all__ = ["exact_forward", "STOCK_OPS", "stock_op"]


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))  # Hugging Face's ReLUSquaredActivation, Primer's ReLU²


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # Hugging Face's QuickGELUActivation (CLIP)


#: canonical expression → torch's op
STOCK_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "x*Phi(x)": F.gelu,
    "x*sigmoid(2*sqrt(2)*(8943*x**3/200000 + x)/sqrt(pi))": lambda x: F.gelu(x, approximate="tanh"),
    "x*sigmoid(x)": F.silu,
    "x*tanh(log(exp(x) + 1))": F.mish,
    "log(exp(x) + 1)": F.softplus,
    "Max(0, x) + Min(0, exp(x) - 1)": F.elu,
    "5253504936777402467096674926473*Max(0, x)/5000000000000000000000000000000 + 5253504936777402467096674926473*"
    "Min(0, 16732632423543772848170429916717*exp(x)/10000000000000000000000000000000 - "
    "16732632423543772848170429916717/10000000000000000000000000000000)/5000000000000000000000000000000": F.selu,
    "x*Min(6, Max(0, x + 3))/6": F.hardswish,
    "Min(1, Max(0, x/6 + 1/2))": F.hardsigmoid,
    "Min(6, Max(0, x))": F.relu6,
    "Min(1, Max(-1, x))": F.hardtanh,
    "Max(0, x)**2": _relu_squared,
    "x*sigmoid(851*x/500)": _quick_gelu,
}


def stock_op(expression: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch's op computing ``expression`` (a generated module's ``EXPRESSION``), or None."""
    return STOCK_OPS.get(expression)


def exact_forward(module, x: torch.Tensor) -> torch.Tensor:
    """f(x) in x's dtype for a generated ``module``: torch's op where it has one, else the module's twin in fp32
    (fp64 stays fp64), rounded once."""
    op = stock_op(module.EXPRESSION)
    if op is not None:
        return op(x)
    return module.activation_twin(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)
