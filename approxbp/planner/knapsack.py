"""The multiple-choice knapsack both planners solve: one option per group, each option (bytes saved, cost), of least
total cost whose savings reach a need — the activation options' gradient error (:func:`~.search._choose`) and
the blocks' moves' modelled seconds (:func:`approxbp.planner.moves.choose_moves`)."""

from __future__ import annotations

import numpy as np

__all__ = ["multiple_choice"]


def multiple_choice(groups: list[list[tuple[int, float]]], need: int, unit: int) -> tuple[float, list[int]] | None:
    """(least total cost, the chosen option's index per group) with Σ saving ≥ ``need``, or None when no choice
    reaches it. A dynamic program over the saving in units of ``unit`` bytes: savings rounded down, the need up, so
    the choice is never short; best[s] is the least cost saving s units (s = cap: at least cap)."""
    cap = -(-need // unit)
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    trail = []
    for options in groups:
        new, pick, source = np.full(cap + 1, np.inf), np.zeros(cap + 1, int), np.zeros(cap + 1, int)
        for j, (saving, cost) in enumerate(options):
            k = min(max(saving, 0) // unit, cap)
            cand, src = np.full(cap + 1, np.inf), np.arange(cap + 1) - k
            cand[k:cap] = best[:cap - k] + cost
            top = cap - k + int(np.argmin(best[cap - k:]))  # any s ≥ cap − k reaches the cap
            cand[cap], src[cap] = best[top] + cost, top
            better = cand < new
            new[better], pick[better], source[better] = cand[better], j, src[better]
        trail.append((pick, source))
        best = new
    if not np.isfinite(best[cap]):
        return None
    chosen, s = [], cap
    for pick, source in reversed(trail):
        chosen.append(int(pick[s]))
        s = source[s]
    return float(best[cap]), chosen[::-1]
