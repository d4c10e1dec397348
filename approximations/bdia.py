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

__all__ = ["bound", "check_gamma", "check_representable", "draw_gammas", "first_step", "from_fixed", "gamma_term",
           "GAMMAS", "inference_step", "inverse", "inverse_fixed", "per_sample", "plain_inverse", "plain_step",
           "quantize", "rest_term", "run", "step", "step_fixed", "to_fixed"]


_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
GAMMAS = (0.5, -0.5)


def bound(dtype: torch.dtype, level: int) -> float:
    """Largest |v| for which eqs. 21/24 stay exact in ``dtype`` at quantisation level l."""
    if dtype not in _SIGNIFICAND_BITS:
        raise TypeError(f"BDIA quantisation needs a floating dtype in {list(_SIGNIFICAND_BITS)}, got {dtype}")
    return 2.0 ** (_SIGNIFICAND_BITS[dtype] - level - 2)


def check_representable(v: torch.Tensor, level: int, block: int | str) -> None:
    b = bound(v.dtype, level)
    worst = float(v.detach().abs().max()) if v.numel() else 0.0
    if not worst < b:
        raise ValueError(f"BDIA block {block}: |value| = {worst:g} reaches the exactness bound {b:g} for "
                         f"{v.dtype} at l = {level} (|v|·2^l must stay below 2^(m−2)); lower l or use float64")


class _QuantizeSTE(torch.autograd.Function):
    """Q_l in the forward; the identity in the backward (straight-through), as training through eq. 21 needs."""

    @staticmethod
    def forward(ctx, v, level):
        return torch.round(v * 2.0**level) * 2.0**-level

    @staticmethod
    def backward(ctx, g):
        return g, None


def quantize(v: torch.Tensor, level: int) -> torch.Tensor:
    """Q_l[v] = round(v / 2^{-l})·2^{-l} (eq. 17), round half to even; straight-through gradient."""
    return _QuantizeSTE.apply(v, level)


def draw_gammas(seed: int, blocks: int, batch: int, values: tuple[float, ...] = GAMMAS) -> torch.Tensor:
    """γ_k per sample for k = 1…K−1 (row k−1), uniform over ``values``, from its own seeded generator.

    Exact reversibility needs γ ∈ {±0.5}; Table 3's sets (0, ±0.25, ±0.6) are allowed for the plain update.
    """
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(values), (max(blocks - 1, 0), batch), generator=g)
    return torch.tensor(values, dtype=torch.float64)[idx]


def _side_bits(x_prev: torch.Tensor, level: int) -> torch.Tensor:
    """s = 1 where x_{k−1}/2^{-l} is odd (eq. 20), as bool (no gradient flows through it)."""
    return torch.remainder(torch.round(x_prev.detach() * 2.0**level), 2) == 1


def check_gamma(gamma) -> None:
    """γ must be ±0.5 (a float, or a per-sample tensor broadcastable against the activations)."""
    g = torch.as_tensor(gamma)
    if not torch.all((g == 0.5) | (g == -0.5)):
        raise ValueError(f"exact BDIA needs γ ∈ {GAMMAS} (a power of two, Remark 4.5), got {gamma}")


def per_sample(gamma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A length-B γ vector shaped [B, 1, …, 1] in ``like``'s dtype and device, for broadcasting."""
    return gamma.to(like.device, like.dtype).view(-1, *([1] * (like.dim() - 1)))


def gamma_term(x_prev, s, gamma, level: int):
    """The term of eq. 21 that reads x_{k−1}: Q_l[γ(x_{k−1} + s·2^{-l})] (exact by Prop. 4.3)."""
    return quantize(gamma * (x_prev + s.to(x_prev.dtype) * 2.0**-level), level)  # s is bool: keep x's dtype


def _mix(x, hx, gamma):
    """(1−γ)x_k + (1+γ)h_k(x_k): the part of eqs. 10, 21 and 24 that reads x_k."""
    return (1 - gamma) * x + (1 + gamma) * hx


def rest_term(x, hx, gamma, level: int):
    """The term of eq. 21 that reads x_k: Q_l[(1−γ)x_k + (1+γ)h_k(x_k)]."""
    return quantize(_mix(x, hx, gamma), level)


def first_step(x0, hx0, level: int):
    """Eq. 19: x_1 = x_0 + Q_l[h_0(x_0)] (x_0 already on the grid, eq. 18)."""
    return x0 + quantize(hx0, level)


def inference_step(x, hx, level: int):
    """Eq. 25 (γ replaced by E[γ] = 0): x_{k+1} = Q_l[x_k + h_k(x_k)]."""
    return quantize(x + hx, level)


# -- fixed-point storage: X = v·2^l held in int64, exact at any magnitude -------------------------
def to_fixed(v: torch.Tensor, level: int) -> torch.Tensor:
    """Integer grid index X = round(v·2^l) as int64 (|X| < 2^63)."""
    return torch.round(v.double() * 2.0**level).to(torch.int64)


def from_fixed(X: torch.Tensor, level: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """v = X·2^{-l} in ``dtype`` (the float view that h_k reads; rounding here is deterministic)."""
    return X.to(dtype) * 2.0**-level


def _sign(gamma) -> torch.Tensor:
    return torch.where(torch.as_tensor(gamma) > 0, 1, -1).to(torch.int64)


def step_fixed(X_prev, X, hx, gamma, level: int):
    """Eq. 21 on integer grid indices: X_{k+1} = γ(X_{k−1} + s) + round(2^l((1−γ)x_k + (1+γ)h_k)).

    X_{k−1} + s is even, so γ(X_{k−1} + s) = ±(X_{k−1} + s)/2 is an exact integer; the sum is exact in int64
    whatever the magnitude. Returns (X_{k+1}, s).
    """
    check_gamma(gamma)
    s = X_prev.remainder(2)
    half = torch.div(X_prev + s, 2, rounding_mode="floor")
    X_next = _sign(gamma) * half + to_fixed(_mix(from_fixed(X, level, hx.dtype), hx, gamma), level)
    return X_next, s.bool()


def inverse_fixed(X, X_next, hx, s, gamma, level: int):
    """Eq. 24 on integer grid indices: X_{k−1} = (X_{k+1} − round(2^l(…)))/γ − s, exact in int64."""
    check_gamma(gamma)
    rest = X_next - to_fixed(_mix(from_fixed(X, level, hx.dtype), hx, gamma), level)
    return 2 * _sign(gamma) * rest - s.to(torch.int64)


def step(x_prev, x, hx, gamma, level: int, block: int = 0):
    """Eq. 21: x_{k+1} = Q_l[γ(x_{k−1} + s·2^{-l})] + Q_l[(1−γ)x_k + (1+γ)h_k(x_k)]; returns (x_{k+1}, s)."""
    check_gamma(gamma)
    for v in (x_prev, x):
        check_representable(v, level, block)
    s = _side_bits(x_prev, level)
    x_next = gamma_term(x_prev, s, gamma, level) + rest_term(x, hx, gamma, level)
    check_representable(x_next, level, block)
    return x_next, s


def inverse(x, x_next, hx, s, gamma, level: int, block: int = 0):
    """Eq. 24: x_{k−1} = x_{k+1}/γ − s·2^{-l} − Q_l[(1−γ)x_k + (1+γ)h_k(x_k)]/γ."""
    check_gamma(gamma)
    for v in (x, x_next):
        check_representable(v, level, block)
    return (x_next - rest_term(x, hx, gamma, level)) / gamma - s.to(x.dtype) * 2.0**-level


def plain_step(x_prev, x, hx, gamma: float):
    """Eq. 10 (no quantisation): x_{k+1} = γx_{k−1} + (1−γ)x_k + (1+γ)h_k(x_k)."""
    return gamma * x_prev + (1 - gamma) * x + (1 + gamma) * hx


def plain_inverse(x, x_next, hx, gamma: float):
    """Eq. 16: x_{k−1} = x_{k+1}/γ − (1−γ)/γ·x_k − (1+γ)/γ·h_k(x_k) (errors are amplified by 1/|γ| = 2)."""
    return x_next / gamma - (1 - gamma) / gamma * x - (1 + gamma) / gamma * hx


def run(branches, x, gammas: torch.Tensor, level: int | None = None):
    """The whole forward: states x_0…x_K and side bits s_0…s_{K−2}, through autograd when it is on.

    ``level=l``: eqs. 18–21 (every step checked against the exactness bound); ``level=None``: eqs. 6 and 10.
    ``gammas``: [K−1, B], one γ per sample per block (row k−1 for block k), e.g. from :func:`draw_gammas`.
    """
    if level is None:
        xs = [x, x + branches[0](x)]
    else:
        x0 = quantize(x, level)
        xs = [x0, first_step(x0, branches[0](x0), level)]
    sides = []
    for k in range(1, len(branches)):
        g, hx = per_sample(gammas[k - 1], x), branches[k](xs[k])
        if level is None:
            xs.append(plain_step(xs[k - 1], xs[k], hx, g))
        else:
            x_next, s = step(xs[k - 1], xs[k], hx, g, level, k)
            xs.append(x_next)
            sides.append(s)
    return xs, sides
