"""Certified optimality of ReLU-sum tables (approx-bp §4.2, eqs. 14 and 63): rigorous enclosures of a table's
objective by Arb's integration, and global optimality for k ≤ 2 by branch and bound over knot boxes.

k = 1: the constraints Σw = 1, Σw·c = 0 leave one feasible point. k = 2 (three knots): the levels enter linearly
and are projected out in closed form (:class:`DerivativeObjectiveK2`, :class:`PrimitiveObjectiveK2`), leaving
J(c₁, d₁, d₂) on ordered knots c₁ ≤ c₂ = c₁ + d₁ ≤ c₃ = c₂ + d₂ in the table's interval [A, B]. Boxes are bounded
below by monotone terms, the mean-value form and the second-order form; around the table's knots an interval
Hessian proves strict convexity (:func:`_convex_box`).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations.activations import x as X_SYMBOL
from approxbp.approximations.pieces import piece
from approxbp.approximations.tables import as_table
from flint import arb

from . import intervals as iv
from .intervals import complex_function
from .objectives_k2 import DerivativeObjectiveK2, PrimitiveObjectiveK2
from .progress import heartbeat

__all__ = ["certify_relu_sum_global", "OptimalityCertificate", "relu_sum_objective"]


@iv.at_precision
def relu_sum_objective(t) -> arb:
    """A rigorous enclosure of the table's objective E(w, c) = ∫_A^B (t − h̃)² with t = h (primitive, eq. 14) or
    h′ (derivative, eq. 63), for the table's own numbers (knots and levels as stored): Arb's adaptive
    Gauss–Legendre integration with error bounds, on each piece between knots (h̃ is linear there)."""
    from flint import acb

    t = as_table(t)
    act = get_activation(t.expression)
    order = 0 if t.objective == "primitive" else 1
    A, B = (arb(v) for v in t.interval)
    knots = [arb(c) for c in t.knots]
    levels = [arb(v) for v in t.levels]  # h̃′ on (−∞, c1), (c1, c2), …, (cn, ∞)
    kinks = [arb(k) for k in act.kinks()]  # a piecewise h: integrated piece by piece, each piece analytic
    breaks = sorted({A, *(c for c in (*knots, *kinks) if A < c < B), B}, key=lambda v: float(v.mid()))
    targets: dict = {}
    total = arb(0)
    for a, b in zip(breaks[:-1], breaks[1:]):
        mid = (a + b) / 2
        here = piece(act.expr, float(mid.mid())) if kinks else act.expr
        if here not in targets:
            targets[here] = complex_function(sp.diff(here, X_SYMBOL) if order else here, X_SYMBOL)
        target = targets[here]
        j = sum(1 for c in knots if c < mid)  # the segment's level index
        slope = levels[j]
        value = sum((levels[i + 1] - levels[i]) * (a - knots[i]).nonnegative_part() for i in range(len(knots))) \
            if order == 0 else arb(0)  # h̃(a) = Σ w_i·ReLU(a − c_i), w_i = L_{i+1} − L_i

        def integrand(z, analytic, a=a, value=value, slope=slope, target=target):
            approx = acb(value) + acb(slope) * (z - a) if order == 0 else acb(slope)
            r = target(z, analytic) - approx
            return r * r

        total += acb.integral(integrand, a, b, rel_tol=2.0 ** -80).real
    return total


@dataclass
class OptimalityCertificate:
    """Branch and bound over knot boxes: every feasible c has J(c) ≥ ``lower``; the table's J is ≤ ``value``;
    ``gap`` = (value − lower)/value is the certified relative distance to the global optimum."""

    table: str
    value: float
    lower: float
    gap: float
    target_gap: float
    passed: bool
    boxes: int
    seconds: float
    note: str

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "table"}


@iv.at_precision
def certify_relu_sum_global(t, target_gap: float = 1e-9, budget_s: float = 300.0,
                            max_boxes: int | None = None, say=None) -> OptimalityCertificate:
    """Global optimality of a k ≤ 2 table over knots in its interval [A, B]. k = 1: Σw = 1 and Σw·c = 0 leave one
    feasible point (w = 1, c = 0), so the table is the optimum when it is that point. k = 2, either objective:
    branch and bound over knot boxes (:class:`DerivativeObjectiveK2`, :class:`PrimitiveObjectiveK2`): the box with
    the smallest lower bound (monotone terms, mean-value and second-order forms) is split along its side of largest
    scaled width, boxes whose lower bound exceeds the table's value are pruned. Around the table's knots the largest
    box on which an interval Hessian proves J strictly convex is bounded by strong convexity instead. The certified
    gap is (value − smallest lower bound)/value; a box centre with a smaller J than the table's fails it. The search
    stops at ``budget_s`` seconds or ``max_boxes`` boxes bounded, whichever comes first (a work budget gives the
    same answer on any machine and load)."""
    start = time.perf_counter()
    t = as_table(t)
    value = float(relu_sum_objective(t).upper())
    if not (math.isfinite(value) and value > 0):
        return OptimalityCertificate(t.name, value, -math.inf, math.inf, target_gap, False, 0,
                                     round(time.perf_counter() - start, 2),
                                     f"the table's objective has no finite positive enclosure ({value}): no gap "
                                     "can be certified against it")
    if t.bits == 1:
        ok = list(t.knots) == [0.0] and list(t.levels) == [0.0, 1.0]
        return OptimalityCertificate(t.name, value, value if ok else -math.inf, 0.0 if ok else math.inf, target_gap,
                                     ok, 0, round(time.perf_counter() - start, 2),
                                     "k = 1: the constraints leave one feasible point, w = 1 at c = 0")
    if t.bits != 2:
        raise ValueError(f"{t.name}: global certificates are implemented for k = 1 and k = 2 (three knots)")
    J = DerivativeObjectiveK2(t) if t.objective == "derivative" else PrimitiveObjectiveK2(t)
    J.cutoff = value
    local, radius = _convex_box(J, J.coordinates.of(t.knots))
    note = f"branch and bound over knot boxes ({t.objective} objective, closed-form projection)"
    if local is not None:
        note += f"; strictly convex within ±{radius:g} of the table's knots (interval Hessian)"
    inner = [(arb(p) - radius, arb(p) + radius) for p in J.coordinates.of(t.knots)] if local is not None else None
    search = _branch_and_bound(J, t, value, inner, target_gap, budget_s, max_boxes, start, say)
    lower_all = min(search.lower, local if local is not None else value)
    if search.best < value * (1 - 1e-12):
        note += f"; a better point exists: J = {search.best!r} < the table's {value!r}"
    if search.unbounded:
        note += (f"; {search.unbounded} of {search.boxes} boxes had no finite lower bound (NaN or overflow in the "
                 f"enclosure) and were kept and split" + (f", {search.open_unbounded} of them still open: the gap "
                                                          "is unbounded" if search.open_unbounded else ""))
    gap = max(0.0, (value - lower_all) / value) if math.isfinite(lower_all) else math.inf
    passed = gap <= target_gap and search.best >= value * (1 - 1e-12)
    return OptimalityCertificate(t.name, value, lower_all, gap, target_gap, passed, search.boxes,
                                 round(time.perf_counter() - start, 2), note)


def _convex_box(J, point: list[float]) -> tuple[float | None, float]:
    """(lower bound of J by strong convexity, radius) on the largest box of
    :attr:`~.objectives_k2.ProjectedK2.convex_radii` around ``point`` where an interval Hessian proves J strictly
    convex; (None, 0) when none does."""
    if _plainly_not_convex(J, point):
        return None, 0.0
    for r in J.convex_radii:
        local = J.convex_lower(point, r, piece=J.convex_piece or r)
        if local is not None:
            return local, r
    return None, 0.0


def _plainly_not_convex(J, point: list[float], step: float = 1e-5, margin: float = 1e-3) -> bool:
    """Whether ∇²J at ``point`` (central differences of the closed-form gradient, symmetrised) has an eigenvalue
    below −margin·‖∇²J‖₂. Then no box around the point is convex (a Hessian proven positive definite on a box is so
    at the point too), so every radius of :func:`_convex_box` would fail, after sympy built ∇²J and ∇³J (seconds:
    most of a certificate of a table moved off its optimum). False where it cannot tell (a gradient not finite);
    a wrong True could only cost a certificate its convex box, never make it claim more."""
    columns = []
    for k in range(3):
        sides = []
        for sign in (1, -1):
            _, g = J.value_gradient(*(arb(p) + (sign * step if i == k else 0) for i, p in enumerate(point)))
            if g is None or not all(gi.is_finite() for gi in g):
                return False
            sides.append(np.array([float(gi.mid()) for gi in g]))
        columns.append((sides[0] - sides[1]) / (2 * step))
    H = np.array(columns)
    H = (H + H.T) / 2
    return bool(np.isfinite(H).all() and np.linalg.eigvalsh(H)[0] < -margin * np.linalg.norm(H, 2))


class _Search(NamedTuple):
    """What a branch and bound ended with: ``lower`` (the smallest lower bound of the open boxes, ``value`` when
    none is left, −∞ while a box without a finite bound is open), ``best`` (the smallest J seen at a box centre),
    ``boxes`` bounded, ``unbounded`` (boxes whose bound was not finite: each kept and split, never dropped) and
    ``open_unbounded`` (those still open at the end)."""

    lower: float
    best: float
    boxes: int
    unbounded: int
    open_unbounded: int


def _branch_and_bound(J, t, value: float, inner, target_gap: float, budget_s: float, max_boxes: int | None,
                      start: float, say) -> _Search:
    """The box with the smallest lower bound is split along its side of largest scaled width until the gap closes
    to ``target_gap`` or the budget is spent. Boxes inside ``inner`` (the convex box) and boxes whose *finite* lower
    bound exceeds ``value`` are dropped; a box whose bound is NaN or infinite counts as bounded by −∞: it is kept,
    split first, and while one is open the gap is unbounded (a NaN compared raw would drop it: ``nan <= v`` is
    False)."""
    heap, count, best, unbounded = [], 0, value, 0

    def push(lo, hi):
        nonlocal count, best, unbounded
        if not J.feasible(lo, hi):
            return
        if inner and all(a >= ia and b <= ib for a, b, (ia, ib) in zip(lo, hi, inner)):
            return  # inside the convex box: bounded below by the convexity certificate
        low, at = J.lower_bound(lo, hi)
        count += 1
        if math.isfinite(at):
            best = min(best, at)
        low = iv.kept(low)
        unbounded += low == -math.inf
        if low <= value * (1 + 1e-15):
            heapq.heappush(heap, (low, count, lo, hi))

    push(*J.coordinates.start_box(arb(t.interval[0]), arb(t.interval[1])))
    tick = heartbeat(say, f"{t.name} global optimum")
    while heap:
        low = heap[0][0]
        tick(lambda low=low: f"{count} boxes, gap {(value - low) / value:.3e}")
        if value - low <= target_gap * value or time.perf_counter() - start > budget_s or (
                max_boxes is not None and count >= max_boxes):
            break
        _, _, lo, hi = heapq.heappop(heap)
        widths = [float((b - a).upper()) * scale for a, b, scale in zip(lo, hi, J.split_scale)]
        i = int(np.argmax(widths))
        m = ((lo[i] + hi[i]) / 2).mid()
        if not (lo[i] < m < hi[i]):
            heapq.heappush(heap, (low, 0, lo, hi))  # cannot split further: it stays open
            break
        push(lo, [*hi[:i], m, *hi[i + 1:]])
        push([*lo[:i], m, *lo[i + 1:]], hi)
    still = sum(1 for entry in heap if entry[0] == -math.inf)
    return _Search(heap[0][0] if heap else value, best, count, unbounded, still)
