"""``approxbp plan … --pareto --gpu G``: the planner's whole curve — peak against modelled step time
against the gradient-error bound — over budgets from the exact step's peak to the lowest any plan reaches.

Two stretches, each measured once and then chosen at every budget:

1. **Approximations**: between the exact peak and the most-saving assignment's, the least-error assignment within
   each budget (:meth:`~.search.Search.assignments`, measured), timed by the roofline (:func:`~.plan_moves.timed`);
   its error bound is the largest of its layers' (the certified L∞ of InvAct, a ReLU-sum's E[(h̃′ − f′)²]^½).
2. **Moves**: below that, any of those assignments with the recompute / offload / chunked-loss moves, whichever
   reaches the budget in the least modelled time (:func:`~.plan_moves.fastest`: the approximations and the
   moves chosen jointly), down to the lowest budget they reach (bisection).

Every time is a roofline model on fake tensors for the named GPU, not a measurement.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

from approxbp.planner.gpus import gpu as step_gpu
from approxbp.planner.plan_moves import Weighed, fastest, modelled_time, move_costs
from approxbp.planner.plan_step import measurer
from approxbp.planner.request import Request
from approxbp.planner.search import Search, distinct, measure_options, spread
from approxbp.planner.step_memory import size

__all__ = ["CompiledAt", "CurvePoint", "figure", "frontier", "pareto", "table", "write_json"]


@dataclass(frozen=True)
class CompiledAt:
    """A compiled point's plan: the assignment and MS-norms, compiled at this ``activation_memory_budget``."""

    activation_memory_budget: float
    choice: dict[str, str]
    ms_norm: bool


@dataclass(frozen=True)
class CurvePoint:
    """One point of the curve: the budget, the modelled peak and step seconds there, the gradient-error bound and
    what the plan does, in words (and, compiled, its :class:`CompiledAt`)."""

    budget: int
    peak: int
    seconds: float
    error: float
    plan: str
    compile: CompiledAt | None = None


def pareto(request: Request, *, gpu: str, points: int = 5, compile_budgets: tuple[float, ...] = (),
           progress=None) -> list[CurvePoint]:
    """The curve's points, highest peak first: budget, modelled peak, modelled seconds, the error bound, and what
    the plan does there (module docstring). ``compile_budgets``: each assignment also compiled at each of these
    ``activation_memory_budget`` values (:mod:`approxbp.planner.compiled`), and the curve is the points no other point
    beats on both peak and time."""
    if points < 2:
        raise ValueError(f"--pareto {points}: expected at least 2 points per stretch")
    say = progress or (lambda msg: None)
    device = step_gpu(gpu)
    run = measurer(request)
    search = Search(run, request, measure_options(run, say), gpu, say=say)
    found, curve, weighed = search.assignments(points), [], []
    for a in distinct(found):
        weighed.append(Weighed(a, *move_costs(run, request, a.choice, a.ms_norm, a.after, device, say,
                                              search.discovery)))
    for budget, a in found:
        w = next(w for w in weighed if (w.assignment.choice, w.assignment.ms_norm) == (a.choice, a.ms_norm))
        curve.append(CurvePoint(budget, a.after.peak, modelled_time(w.time, w.blocks), a.error,
                                _described(a.choice, a.ms_norm)))
    itemsize = request.setup.dtype.itemsize
    lowest = found[-1][1].after.peak
    lo, hi = 0, lowest  # the lowest budget any assignment's moves reach, to 1 %
    while hi - lo > lowest // 100:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fastest(weighed, mid, device, itemsize) else (mid, hi)
    for budget in spread(lowest, hi, points)[1:]:
        w, m = fastest(weighed, budget, device, itemsize)
        curve.append(CurvePoint(budget, m.peak, m.seconds_after, w.assignment.error,
                                _described(w.assignment.choice, w.assignment.ms_norm) + "; " + ", ".join(
                                    _MOVED[k].format(n) for k, n in m.by_move.items() if n)))
    if compile_budgets:
        curve = frontier(curve + _compiled(request, device, weighed, compile_budgets, say))
    return curve


def _compiled(request: Request, device, weighed, budgets, say) -> list[CurvePoint]:
    """Every weighed assignment compiled at each budget, as curve points."""
    from approxbp.planner.compiled import points

    out = []
    for w in weighed:
        a = w.assignment
        say(f"compiled: {_described(a.choice, a.ms_norm)}")
        for p in points(request, device, a.choice, a.ms_norm, a.after.peak, budgets, say):
            out.append(CurvePoint(p.peak, p.peak, p.seconds, a.error,
                                  f"{_described(a.choice, a.ms_norm)}; torch.compile, activation_memory_budget "
                                  f"{p.budget}", CompiledAt(p.budget, a.choice, a.ms_norm)))
    return out


def frontier(points: list[CurvePoint]) -> list[CurvePoint]:
    """The points no other beats: a point stays unless another has a peak and a time no larger and a smaller
    (time, error, peak), or the same and comes first (the simpler plan: the eager curve, then the assignments in
    order); highest peak first."""
    def key(p):
        return p.seconds, p.error, p.peak

    def beats(j, q, i, p):
        return q.peak <= p.peak and q.seconds <= p.seconds and (key(q) < key(p) or key(q) == key(p) and j < i)

    kept = [p for i, p in enumerate(points) if not any(beats(j, q, i, p) for j, q in enumerate(points))]
    return sorted(kept, key=lambda p: -p.peak)


_MOVED = {"recompute": "blocks recomputed: {}", "recompute part": "parts recomputed alone: {}",
         "offload": "offloaded: {}", "chunked-loss": "loss chunked"}


def _described(choice: dict[str, str], ms_norm: bool) -> str:
    counts: dict[str, int] = {}
    for option in choice.values():
        counts[option] = counts.get(option, 0) + 1
    return ", ".join([f"{n} × {o}" for o, n in sorted(counts.items())] + (["MS-norms"] if ms_norm else [])) or "exact"


def table(curve: list[CurvePoint], gpu: str) -> str:
    """The curve as text, with the caveat that its times are a model."""
    lines = [f"{'budget':>12} {'peak':>12} {'modelled ms':>12} {'error bound':>12}  plan"]
    lines += [f"{size(c.budget):>12} {size(c.peak):>12} {1e3 * c.seconds:>12.4g} {c.error:>12.3g}  {c.plan}"
              for c in curve]
    lines.append(f"(times: a roofline on fake tensors for {step_gpu(gpu).name}, no host time: a model, not a "
                 "measurement)")
    return "\n".join(lines)


def figure(curve: list[CurvePoint], path: Path, title: str) -> Path:
    """Peak against modelled step time, each point coloured by its gradient-error bound (log scale); a compiled
    point (``--compile-budgets``) drawn as a square."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    peaks = [c.peak / 2**30 for c in curve]
    ms = [1e3 * c.seconds for c in curve]
    ax.plot(ms, peaks, color="0.7", zorder=1)
    errors = [max(c.error, 1e-9) for c in curve]
    scale = LogNorm(vmin=1e-9, vmax=max(1.0, max(errors)))
    for compiled, marker, label in ((False, "o", "eager"), (True, "s", "torch.compile at a budget")):
        picked = [i for i, c in enumerate(curve) if (c.compile is not None) == compiled]
        if picked:
            dots = ax.scatter([ms[i] for i in picked], [peaks[i] for i in picked], c=[errors[i] for i in picked],
                              cmap="viridis", norm=scale, marker=marker, zorder=2, label=label)
    if any(c.compile is not None for c in curve):
        ax.legend(fontsize=8)
    fig.colorbar(dots, ax=ax, label="gradient-error bound (exact plotted at 1e-9)")
    ax.set(xlabel="modelled step time (ms, roofline)", ylabel="modelled peak (GiB)")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(curve: list[CurvePoint], path: Path, meta: dict) -> Path:
    """The curve and ``meta`` as JSON, written atomically (a point without ``compile``: no such key)."""
    from approxbp.approximations.files import write_atomic

    points = [{k: v for k, v in asdict(c).items() if k != "compile" or v is not None} for c in curve]
    write_atomic(path, json.dumps({**meta, "curve": points}, indent=1) + "\n")
    return path

