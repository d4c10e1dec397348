"""Accuracy helper shared by the kernel tests."""

import torch


def tolerance_ok(ours, torch_ref, truth, x=None, activation=None, ulps=4):
    """|ours − truth| ≤ 2·|torch − truth| + 4 ulp(truth): as good as torch in that dtype, to a few ulp. "torch" is
    the twin and, for an activation torch has (given ``x``), torch's own op too (the worse of the two): the twin's
    Φ = erfc(−u/√2)/2 keeps GELU's left tail, while the kernel's Φ = (1 + erf)/2 (Triton has no erfc) cancels
    there exactly as F.gelu does."""
    ulp = torch.finfo(ours.dtype).eps * truth.abs().double()
    err = (ours.double() - truth.double()).abs()
    ref = (torch_ref.double() - truth.double()).abs()
    native = _NATIVE.get(activation)
    if native is not None and x is not None:
        ref = torch.maximum(ref, (native(x.detach()).double() - truth.double()).abs())
    return bool(torch.all((err <= 2 * ref + ulps * ulp + 1e-30) | torch.isnan(truth)))


_NATIVE = {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "mish": torch.nn.functional.mish,
           "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}
