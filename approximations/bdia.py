"""BDIA updates (BDIA-transformer §4.2–4.3): the plain update (eq. 10) and its inverse (eq. 16), the
quantiser Q_l (eq. 17), the quantised update with side bits (eqs. 18–21), and its exact inverse (eq. 24).

Exactness needs every value on the 2^{-l} grid, and every intermediate of eqs. 21/24, to be exactly
representable. With m significand bits (fp64 53, fp32 24, bf16 8, fp16 11), a multiple of 2^{-l} is exact
while |v|·2^l ≤ 2^m. Intermediates reach |γ(x + s·2^{-l})| and 2|x_{k+1}|, so the bound checked is
|v| < 2^{m−l−2} for every input and output of a step. A value outside raises ValueError (block, value,
bound); exactness is never lost silently. Integer storage (int32/int64 holding v·2^l) is exact regardless.
"""

from __future__ import annotations

import torch

SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
GAMMAS = (0.5, -0.5)


def bound(dtype: torch.dtype, level: int) -> float:
    """Largest |v| for which eqs. 21/24 stay exact in ``dtype`` at quantisation level l."""
    if dtype not in SIGNIFICAND_BITS:
        raise TypeError(f"BDIA quantisation needs a floating dtype in {list(SIGNIFICAND_BITS)}, got {dtype}")
    return 2.0 ** (SIGNIFICAND_BITS[dtype] - level - 2)


def check_representable(v: torch.Tensor, level: int, block: int | str) -> None:
    b = bound(v.dtype, level)
    worst = float(v.detach().abs().max()) if v.numel() else 0.0
    if not worst < b:
        raise ValueError(f"BDIA block {block}: |value| = {worst:g} reaches the exactness bound {b:g} for "
                         f"{v.dtype} at l = {level} (|v|·2^l must stay below 2^(m−2)); lower l or use float64")


def quantize(v: torch.Tensor, level: int) -> torch.Tensor:
    """Q_l[v] = round(v / 2^{-l})·2^{-l} (eq. 17), round half to even."""
    return torch.round(v * 2.0**level) * 2.0**-level


def side_bits(x_prev: torch.Tensor, level: int) -> torch.Tensor:
    """s = 1 where x_{k−1}/2^{-l} is odd (eq. 20), as bool."""
    return torch.remainder(torch.round(x_prev * 2.0**level), 2) == 1


def check_gamma(gamma: float) -> float:
    if gamma not in GAMMAS:
        raise ValueError(f"exact BDIA needs γ ∈ {GAMMAS} (a power of two, Remark 4.5), got {gamma}")
    return gamma


def step(x_prev, x, hx, gamma: float, level: int, block: int = 0):
    """Eq. 21: x_{k+1} = Q_l[γ(x_{k−1} + s·2^{-l})] + Q_l[(1−γ)x_k + (1+γ)h_k(x_k)]; returns (x_{k+1}, s)."""
    check_gamma(gamma)
    for v in (x_prev, x):
        check_representable(v, level, block)
    s = side_bits(x_prev, level)
    x_next = quantize(gamma * (x_prev + s * 2.0**-level), level) + quantize((1 - gamma) * x + (1 + gamma) * hx, level)
    check_representable(x_next, level, block)
    return x_next, s


def inverse(x, x_next, hx, s, gamma: float, level: int, block: int = 0):
    """Eq. 24: x_{k−1} = x_{k+1}/γ − s·2^{-l} − Q_l[(1−γ)x_k + (1+γ)h_k(x_k)]/γ."""
    check_gamma(gamma)
    for v in (x, x_next):
        check_representable(v, level, block)
    return (x_next - quantize((1 - gamma) * x + (1 + gamma) * hx, level)) / gamma - s * 2.0**-level


def plain_step(x_prev, x, hx, gamma: float):
    """Eq. 10 (no quantisation): x_{k+1} = γx_{k−1} + (1−γ)x_k + (1+γ)h_k(x_k)."""
    return gamma * x_prev + (1 - gamma) * x + (1 + gamma) * hx


def plain_inverse(x, x_next, hx, gamma: float):
    """Eq. 16: x_{k−1} = x_{k+1}/γ − (1−γ)/γ·x_k − (1+γ)/γ·h_k(x_k) (errors are amplified by 1/|γ| = 2)."""
    return x_next / gamma - (1 - gamma) / gamma * x - (1 + gamma) / gamma * hx
