"""The toy family's fit and certificate. The least-squares levels of ∫_A^B (h′ − h̃′)² are the mean slopes of each
side: a = (h(0) − h(A))/(0 − A), b = (h(B) − h(0))/B (no search: the normal equations in closed form)."""

from __future__ import annotations

from approxbp.approximations.families import register
from approxbp.fitting.certify import CERTIFIERS, CertifyFamily
from flint import arb

from .table import FAMILY, ToyStepTable


def fit_toy_step(activation, interval=(-4.0, 4.0)) -> ToyStepTable:
    """The table of ``activation`` (an ``approximations.Activation``) on ``interval``; levels in float64."""
    a, b = (float(v) for v in interval)
    if not a < 0.0 < b:
        raise ValueError(f"interval [{a}, {b}] must hold 0 inside: A < 0 < B")
    h = activation.mp
    levels = (float((h(0) - h(a)) / (0 - a)), float((h(b) - h(0)) / b))
    command = f"approxbp fit toy-step --activation {activation.name} --interval {a!r} {b!r}"
    return ToyStepTable.new(activation, interval=(a, b), levels=levels,
                            provenance={"method": "closed form", "command": command, "package_version": "toy"})


def certify(t, budget_s=None, rtol=None, progress=None, rounded=True, max_boxes=None, lines=None):
    """Each level's enclosure in Arb ball arithmetic (the chord slope evaluated rigorously); held when the stored
    float64 level lies within its enclosure widened by one float64 rounding."""
    from approxbp.approximations.activations import get_activation, x
    from approxbp.fitting.intervals import Ball, Evaluator

    expr = get_activation(t.expression).expr
    h = lambda v: Evaluator()(expr, {x: Ball(arb(v))}).v  # noqa: E731
    (lo, hi), entry, held = t.interval, [], True
    for stored, slope in zip(t.levels, ((h(0) - h(lo)) / (0 - arb(lo)), (h(hi) - h(0)) / arb(hi)), strict=True):
        rounding = arb(abs(stored)) * arb(2.0) ** -52
        held &= bool(slope.lower() - rounding <= arb(stored) <= slope.upper() + rounding)
        entry.append([float(slope.lower()), float(slope.upper())])
    return {"levels": entry}, [f"{t.name}: levels {'inside' if held else 'OUTSIDE'} their enclosures {entry}"], held


register(CERTIFIERS, FAMILY, CertifyFamily(certify, lambda t: True))
