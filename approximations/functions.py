"""The sympy function classes of the expression grammar that sympy lacks: Φ, σ, softplus and select. Their own
module (sympy only), so that the function table (:mod:`.backends`) and the activations (:mod:`.activations`) both
import them and neither imports the other for them."""

from __future__ import annotations

import sympy as sp

__all__ = ["expm1", "Phi", "piecewise", "select", "sigmoid", "softplus"]


class Phi(sp.Function):
    """The standard normal CDF Φ(z) = (1 + erf(z/√2))/2, kept as one function so that evaluators use
    tail-accurate implementations (scipy ndtr, torch.special.ndtr, mpmath ncdf) instead of 1 + erf."""

    is_real = True

    def fdiff(self, argindex=1):
        z = self.args[0]
        return sp.exp(-(z**2) / 2) / sp.sqrt(2 * sp.pi)


class select(sp.Function):  # noqa: N801 (the name users write)
    """select(c, a, b) = a where c > 0, else b: a branch-free choice (tl.where / np.where / torch.where), for
    piecewise forms. Both a and b are evaluated; NaN in c selects b."""

    nargs = 3
    is_real = True

    def fdiff(self, argindex=1):
        """d/dc: the step's point mass at c = 0, (a − b)·δ(c); d/da = select(c, 1, 0); d/db = select(c, 0, 1)."""
        c, a, b = self.args
        if argindex == 1:
            return sp.DiracDelta(c) * (a - b)
        return select(c, 1, 0) if argindex == 2 else select(c, 0, 1)


def piecewise(pieces: list[tuple[sp.Expr, sp.Expr | None]]) -> sp.Expr:
    """``Piecewise((a, cond), …, (z, True))`` as nested selects: each condition is written c > 0 (``x > 3`` is
    c = x − 3; a condition holds strictly, so at its boundary the next piece is taken); the last piece's is True."""
    *conditional, (last, always) = pieces
    if always is not None or any(c is None for _, c in conditional):
        raise ValueError("Piecewise needs a last piece (expr, True) and a condition on every other")
    out = last
    for value, c in reversed(conditional):
        out = select(c, value, out)
    return out


class sigmoid(sp.Function):  # noqa: N801 (the name users write)
    """σ(z) = 1/(1 + e^{−z}) with σ' = σ(z)·σ(−z): evaluated by expit / torch.sigmoid / tl.sigmoid, so neither
    σ nor its derivative overflows or cancels for large |z|."""

    is_real = True

    def fdiff(self, argindex=1):
        z = self.args[0]
        return sigmoid(z) * sigmoid(-z)


class softplus(sp.Function):  # noqa: N801 (the name users write)
    """log(1 + e^u), kept whole so evaluators use a stable log1p form (and a ball evaluator its endpoints: the ball
    1 + e^[0, 75] holds 0, so log of it is NaN); softplus′ = σ."""

    is_real = True

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])


class expm1(sp.Function):  # noqa: N801 (the name users write)
    """e^u − 1, kept whole so evaluators keep its relative accuracy near u = 0 (ELU); expm1′ = e^u."""

    is_real = True

    def fdiff(self, argindex=1):
        return sp.exp(self.args[0])
