"""torch's own forward for the activations it has an op for: what every drop-in's CPU path returns, so that a
reader sees the stock value bit for bit in the input's dtype (torch computes fp16/bf16 in fp32 and rounds once).
Keyed by registry name: each generated module says which op computes its expression (``STOCK``, set by
``approxbp export``; ``tests/kernels/test_stock.py`` checks each op against its activation in float64). An
activation torch has no op for runs the generated PyTorch twin (fp32 math, fp64 stays fp64). The Triton kernels
compute their own formula (within a few ulp of torch's; measured on a GPU only)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

__all__ = ["exact_forward", "STOCK_OPS", "stock_op"]


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))  # Hugging Face's ReLUSquaredActivation, Primer's ReLU²


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # Hugging Face's QuickGELUActivation (CLIP)


#: registry activation → torch's op. A generated module names the one its table's expression is (``STOCK``, decided
#: by the build side, which compares the expression with each name's); the run time reads that name, no expression.
STOCK_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "mish": F.mish,
    "softplus": F.softplus,
    "elu": F.elu,
    "selu": F.selu,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "relu6": F.relu6,
    "hardtanh": F.hardtanh,
    "relu2": _relu_squared,
    "quick_gelu": _quick_gelu,
}


def stock_op(name: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch's op for a registry activation (a generated module's ``STOCK``), or None."""
    return STOCK_OPS.get(name)


def exact_forward(module, x: torch.Tensor) -> torch.Tensor:
    """f(x) in x's dtype for a generated ``module``: torch's op where it has one, else the module's twin in fp32
    (fp64 stays fp64), rounded once."""
    op = stock_op(module.STOCK)
    if op is not None:
        return op(x)
    return module.activation_twin(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)
