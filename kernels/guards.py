"""Input checks shared by every drop-in's autograd Function."""

from __future__ import annotations

import torch


def check_input(x: torch.Tensor, who: str) -> None:
    """Refuse what torch's own activations refuse: integer and bool tensors."""
    if not x.is_floating_point():
        raise TypeError(f"{who} needs a floating-point tensor, got {x.dtype} (torch's activations refuse it too)")
