"""Input checks shared by every drop-in's autograd Function."""

from __future__ import annotations

import torch


def check_input(x: torch.Tensor, who: str) -> None:
    """Refuse what torch's own activations refuse (integer/bool tensors), and torch.export, which would trace
    the forward into plain ops and differentiate those instead of calling our backward."""
    if not x.is_floating_point():
        raise TypeError(f"{who} needs a floating-point tensor, got {x.dtype} (torch's activations refuse it too)")
    if torch.compiler.is_exporting():
        raise RuntimeError(f"{who}: torch.export would drop the approximate backward (the exported graph would "
                           "differentiate the exact forward); export the stock model, or train with the drop-in")
