"""Input checks shared by every drop-in's autograd Function."""

from __future__ import annotations

import os

import torch

__all__ = ["check_input", "check_triton_available", "check_triton_device"]


def check_input(x: torch.Tensor, who: str) -> None:
    """Refuse what torch's own activations refuse: integer and bool tensors."""
    if not x.is_floating_point():
        raise TypeError(f"{who} needs a floating-point tensor, got {x.dtype} (torch's activations refuse it too)")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_triton_device(x: torch.Tensor) -> None:
    """Triton kernels need a CUDA tensor, or the interpreter (TRITON_INTERPRET=1) for a CPU one: say so in one
    line instead of Triton's "0 active drivers". A ``meta`` tensor passes: nothing runs on it (``approxbp cost``
    calls the launchers with meta tensors while it records their launches; the custom ops' fakes serve meta tensors
    in any other use)."""
    if not (x.is_cuda or x.is_meta) and not _interpreting():
        raise RuntimeError("use_triton=True on a CPU tensor needs the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported; on the CPU the default (use_triton=None) runs the PyTorch twin")


def check_triton_available(use_triton: bool | None) -> None:
    """At module construction: use_triton=True with neither CUDA nor the interpreter cannot work."""
    if use_triton and not torch.cuda.is_available() and not _interpreting():
        raise RuntimeError("use_triton=True needs CUDA, or TRITON_INTERPRET=1 (set before triton is imported) to "
                           "run the kernels on the CPU; leave use_triton=None to use the PyTorch twin")
