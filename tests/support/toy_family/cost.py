"""The toy family's kernels for ``approxbp cost``: its forward and backward launches, captured on meta tensors."""

from __future__ import annotations

import torch
from approxbp.approximations.families import register

from approxbp.cost import LAUNCHES, forward_backward_launches

from .op import FAMILY, ToyStepSpec


def launches(table, dtype: torch.dtype):
    spec = ToyStepSpec(table)
    return forward_backward_launches(f"toy {spec.name()}", dtype,
                                     lambda x: spec.backward_triton(x, spec.forward_triton(x)[1]))


register(LAUNCHES, FAMILY, launches)
