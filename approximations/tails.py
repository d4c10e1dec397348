"""How an activation's ReLU-sum residual vanishes far from 0 (Approx-BP eq. 13: h → 0 as x → −∞, h − x → 0 as
x → +∞), and the residual's mass beyond a point, for any tail: exponential (GELU, SiLU), double exponential
(TanhExp's x·tanh(eˣ)), algebraic (squareplus's 1/|x|).

The residual t(x) = h⁽ᵐ⁾(x) on the left and h⁽ᵐ⁾(x) − (x or 1) on the right (m = 0 primitive, 1 derivative) is
evaluated in 50-digit mpmath at |x| = 8, 16, …, :data:`_FAR` only, never at infinity: a double exponential there
needs an exponent of 10¹⁹ digits, which is what exhausted memory. Its kind is read off the samples: *fast* when
|t(FAR)| < 1e-30 and falling; *algebraic* with power p when |t| halves 2ᵖ-fold per doubling of |x| (p > 0, the last
three doublings within 0.25 of each other); else it does not vanish. The mass ∫ t² beyond L is integrated on
finite pieces up to FAR, plus, for an algebraic tail, the power law's own remainder beyond FAR
(t(FAR)²·FAR/(2p − 1)); it is finite only for p > 1/2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mpmath

__all__ = ["mass_beyond", "residual", "Tail", "tail"]


#: The farthest |x| sampled and integrated to (beyond it: the power law, or nothing for a fast tail).
_FAR = 512.0
_SAMPLES = tuple(2.0 ** k for k in range(3, 10))  # 8 … 512
_FAST = 1e-30


@dataclass(frozen=True)
class Tail:
    """One side's residual: ``kind`` fast, algebraic (∝ |x|^−power) or none; |t| at :data:`_SAMPLES`."""

    side: str  # "left" (x → −∞) or "right" (x → +∞)
    order: int
    kind: str
    power: float | None
    signed: tuple[float, ...]  # t at SAMPLES, with its sign

    @property
    def values(self) -> tuple[float, ...]:
        """|t| at :data:`_SAMPLES`."""
        return tuple(abs(v) for v in self.signed)

    @property
    def vanishes(self) -> bool:
        return self.kind != "none"

    @property
    def square_integrable(self) -> bool:
        return self.kind == "fast" or (self.kind == "algebraic" and self.power > 0.5)

    @property
    def beyond_far(self) -> float:
        """∫ t² beyond :data:`_FAR`: 0 for a fast tail, the power law's own t(FAR)²·FAR/(2p − 1) for an algebraic one
        (∞ for p ≤ ½), ∞ for one that does not vanish."""
        if self.kind == "fast":
            return 0.0
        if self.kind == "algebraic" and self.power > 0.5:
            return self.values[-1] ** 2 * _FAR / (2 * self.power - 1)
        return math.inf

    def describe(self) -> str:
        what = "h" + "′" * self.order + ("" if self.side == "left" else (" − x" if self.order == 0 else " − 1"))
        far = f"{'−' if self.side == 'left' else ''}{_FAR:g}"
        if self.kind == "fast":
            return f"{what} falls faster than any power ({self.values[-1]:.3g} at x = {far})"
        if self.kind == "algebraic":
            return f"{what} falls like |x|^−{self.power:.3g} ({self.values[-1]:.3g} at x = {far})"
        return f"{what} does not tend to 0 ({f'{self.signed[-1]:.6g}'.replace('-', '−')} at x = {far})"


def residual(act, order: int, side: str):
    """t(v) in mpmath at the caller's precision (see the module docstring)."""
    if side == "left":
        return lambda v: act.mp(v, order, None)
    return lambda v: act.mp(v, order, None) - (v if order == 0 else 1)


def tail(act, order: int, side: str) -> Tail:
    """The residual's kind on one side, from 50-digit samples at |x| = 8 … :data:`_FAR`."""
    t = residual(act, order, side)
    sign = -1 if side == "left" else 1
    with mpmath.workdps(50):
        signed = tuple(float(t(mpmath.mpf(sign * v))) for v in _SAMPLES)
    values = tuple(abs(v) for v in signed)
    if not all(math.isfinite(v) for v in values):
        return Tail(side, order, "none", None, signed)
    if values[-1] < _FAST and values[-1] <= values[-2]:
        return Tail(side, order, "fast", None, signed)
    if min(values[-4:]) > 0:
        powers = [math.log2(a / b) for a, b in zip(values[-4:], values[-3:])]
        if min(powers) > 0 and max(powers) - min(powers) < 0.25:
            return Tail(side, order, "algebraic", powers[-1], signed)
    return Tail(side, order, "none", None, signed)


def mass_beyond(act, shape: Tail, at: float) -> float:
    """∫ t² over (−∞, −at] (left) or [at, ∞) (right) of the residual whose ``shape`` :func:`tail` found, at ≥ 0:
    30-digit quadrature on pieces up to :data:`_FAR`, plus :attr:`Tail.beyond_far`."""
    t = residual(act, shape.order, shape.side)
    sign = -1 if shape.side == "left" else 1
    points = [at]
    while points[-1] < _FAR:
        points.append(min(_FAR, max(2 * points[-1], points[-1] + 1)))
    with mpmath.workdps(30):
        inside = mpmath.quad(lambda v: t(sign * v) ** 2, points) if len(points) > 1 else mpmath.mpf(0)
    return float(inside) + shape.beyond_far
