"""``approxbp plan … --pareto --gpu G``: the planner's whole curve — peak against modelled step time
against the gradient-error bound — over budgets from the exact step's peak to the lowest any plan reaches.

Two stretches, each measured once and then chosen at every budget:

1. **Approximations**: between the exact peak and the most-saving assignment's, the least-error assignment within
   each budget (:func:`~.plan.assignments`, measured), timed by the roofline (:func:`~.plan_moves.timed`);
   its error bound is the largest of its layers' (the certified L∞ of InvAct, a ReLU-sum's E[(h̃′ − f′)²]^½).
2. **Moves**: below that, any of those assignments with the recompute / offload / chunked-loss moves, whichever
   reaches the budget in the least modelled time (:func:`~.plan_moves.fastest`: the approximations and the
   moves chosen jointly), down to the lowest budget they reach (bisection).

Every time is a roofline model on fake tensors for the named GPU, not a measurement.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from approxbp.planner.gpus import gpu as step_gpu
from approxbp.planner.plan import assignments, distinct, measure_options, spread
from approxbp.planner.plan_moves import Weighed, fastest, modelled_time, move_costs
from approxbp.planner.plan_step import measurer
from approxbp.planner.request import Request
from approxbp.planner.step_memory import size

__all__ = ["figure", "frontier", "pareto", "table", "write_json"]


def pareto(request: Request, *, gpu: str, points: int = 5, compile_budgets: tuple[float, ...] = (),
           progress=None) -> list[dict]:
    """The curve's points, highest peak first: budget, modelled peak, modelled seconds, the error bound, and what
    the plan does there (module docstring). ``compile_budgets``: each assignment also compiled at each of these
    ``activation_memory_budget`` values (:mod:`approxbp.planner.compiled`), and the curve is the points no other point
    beats on both peak and time."""
    if points < 2:
        raise ValueError(f"--pareto {points}: expected at least 2 points per stretch")
    say = progress or (lambda msg: None)
    device = step_gpu(gpu)
    run = measurer(request)
    base, layers, options, ms = measure_options(run, say)
    found = assignments(run, layers, options, ms, base.peak, say, points)
    curve, weighed = [], []
    for a in distinct(found):
        weighed.append(Weighed(a, *move_costs(run, request, a.choice, a.ms_norm, a.after, device, say)))
    for budget, a in found:
        w = next(w for w in weighed if (w.assignment.choice, w.assignment.ms_norm) == (a.choice, a.ms_norm))
        curve.append({"budget": budget, "peak": a.after.peak, "seconds": modelled_time(w.time, w.blocks),
                      "error": a.error, "plan": _described(a.choice, a.ms_norm)})
    itemsize = request.setup.dtype.itemsize
    lowest = found[-1][1].after.peak
    lo, hi = 0, lowest  # the lowest budget any assignment's moves reach, to 1 %
    while hi - lo > lowest // 100:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fastest(weighed, mid, device, itemsize) else (mid, hi)
    for budget in spread(lowest, hi, points)[1:]:
        w, m = fastest(weighed, budget, device, itemsize)
        curve.append({"budget": budget, "peak": m["peak"], "seconds": m["seconds_after"], "error": w.assignment.error,
                      "plan": _described(w.assignment.choice, w.assignment.ms_norm) + "; " + ", ".join(
                          _MOVED[k].format(n) for k, n in m["by_move"].items() if n)})
    if compile_budgets:
        curve = frontier(curve + _compiled(request, device, weighed, compile_budgets, say))
    return curve


def _compiled(request: Request, device, weighed, budgets, say) -> list[dict]:
    """Every weighed assignment compiled at each budget, as curve points."""
    from approxbp.planner.compiled import points

    out = []
    for w in weighed:
        a = w.assignment
        say(f"compiled: {_described(a.choice, a.ms_norm)}")
        for p in points(request, device, a.choice, a.ms_norm, a.after.peak, budgets, say):
            out.append({"budget": p["peak"], "peak": p["peak"], "seconds": p["seconds"], "error": a.error,
                        "plan": f"{_described(a.choice, a.ms_norm)}; torch.compile, activation_memory_budget "
                                f"{p['budget']}", "compile": {"activation_memory_budget": p["budget"],
                                                               "choice": a.choice, "ms_norm": a.ms_norm}})
    return out


def frontier(points: list[dict]) -> list[dict]:
    """The points no other beats: a point stays unless another has a peak and a time no larger and a smaller
    (time, error, peak), or the same and comes first (the simpler plan: the eager curve, then the assignments in
    order); highest peak first."""
    def key(p):
        return p["seconds"], p["error"], p["peak"]

    def beats(j, q, i, p):
        return q["peak"] <= p["peak"] and q["seconds"] <= p["seconds"] and (key(q) < key(p) or
                                                                              key(q) == key(p) and j < i)

    kept = [p for i, p in enumerate(points) if not any(beats(j, q, i, p) for j, q in enumerate(points))]
    return sorted(kept, key=lambda p: -p["peak"])


_MOVED = {"recompute": "blocks recomputed: {}", "recompute part": "parts recomputed alone: {}",
         "offload": "offloaded: {}", "chunked-loss": "loss chunked"}


def _described(choice: dict[str, str], ms_norm: bool) -> str:
    counts: dict[str, int] = {}
    for option in choice.values():
        counts[option] = counts.get(option, 0) + 1
    return ", ".join([f"{n} × {o}" for o, n in sorted(counts.items())] + (["MS-norms"] if ms_norm else [])) or "exact"


def table(curve: list[dict], gpu: str) -> str:
    """The curve as text, with the caveat that its times are a model."""
    lines = [f"{'budget':>12} {'peak':>12} {'modelled ms':>12} {'error bound':>12}  plan"]
    lines += [f"{size(c['budget']):>12} {size(c['peak']):>12} {1e3 * c['seconds']:>12.4g} {c['error']:>12.3g}  "
              f"{c['plan']}" for c in curve]
    lines.append(f"(times: a roofline on fake tensors for {step_gpu(gpu).name}, no host time: a model, not a "
                 "measurement)")
    return "\n".join(lines)


def figure(curve: list[dict], path: Path, title: str) -> Path:
    """Peak against modelled step time, each point coloured by its gradient-error bound (log scale); a compiled
    point (``--compile-budgets``) drawn as a square."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    peaks = [c["peak"] / 2**30 for c in curve]
    ms = [1e3 * c["seconds"] for c in curve]
    ax.plot(ms, peaks, color="0.7", zorder=1)
    errors = [max(c["error"], 1e-9) for c in curve]
    scale = LogNorm(vmin=1e-9, vmax=max(1.0, max(errors)))
    for compiled, marker, label in ((False, "o", "eager"), (True, "s", "torch.compile at a budget")):
        picked = [i for i, c in enumerate(curve) if ("compile" in c) == compiled]
        if picked:
            dots = ax.scatter([ms[i] for i in picked], [peaks[i] for i in picked], c=[errors[i] for i in picked],
                              cmap="viridis", norm=scale, marker=marker, zorder=2, label=label)
    if any("compile" in c for c in curve):
        ax.legend(fontsize=8)
    fig.colorbar(dots, ax=ax, label="gradient-error bound (exact plotted at 1e-9)")
    ax.set(xlabel="modelled step time (ms, roofline)", ylabel="modelled peak (GiB)")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(curve: list[dict], path: Path, meta: dict) -> Path:
    """The curve and ``meta`` as JSON, written atomically."""
    from approxbp.approximations.files import write_atomic

    write_atomic(path, json.dumps({**meta, "curve": curve}, indent=1) + "\n")
    return path

