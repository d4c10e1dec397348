"""``approxbp plan … --pareto --gpu G`` (issue 46 item 3): the planner's whole curve — peak against modelled step time
against the gradient-error bound — over budgets from the exact step's peak to the lowest any plan reaches.

Two stretches, each measured once and then chosen at every budget:

1. **Approximations**: between the exact peak and the most-saving assignment's, the least-error assignment within
   each budget (:func:`approxbp.plan._within`, measured), timed by the roofline (:func:`approxbp.plan.timed`);
   its error bound is the largest of its layers' (the certified L∞ of InvAct, a ReLU-sum's E[(h̃′ − f′)²]^½).
2. **Moves**: below that, the most-saving assignment with the recompute / offload / chunked-loss moves of least
   modelled time (:func:`approxbp.plan_moves.plan_moves`), down to the lowest budget they reach (bisection).

Every time is a roofline model on fake tensors for the named GPU, not a measurement.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from approxbp.gpus import gpu as step_gpu
from approxbp.plan import NoFit, _within, as_setup, measure_options, move_costs, stepper, timed
from approxbp.plan_moves import modelled_time, plan_moves
from approxbp.step_memory import size


def pareto(model_text: str, batch: int, seq: int, mode, gpu: str, lora_r: int = 8, points: int = 5,
           progress=None) -> list[dict]:
    """The curve's points, highest peak first: budget, modelled peak, modelled seconds, the error bound, and what
    the plan does there (module docstring)."""
    if points < 2:
        raise ValueError(f"--pareto {points}: expected at least 2 points per stretch")
    say = progress or (lambda msg: None)
    device = step_gpu(gpu)
    step = stepper(model_text, mode, lora_r)

    def run(assignment, ms_norm):
        return step(batch, seq, assignment, ms_norm)

    base, layers, options, ms = measure_options(run, say)
    most, after, _ = _within(run, layers, options, ms, base.peak, None, say)
    most_ms = ms["chosen"]
    curve, seconds_of = [], {}
    for budget in _spread(base.peak, after.peak, points):
        try:  # the last budget is the most-saving assignment's own peak: that assignment
            choice, got, _ = ((most, after, None) if budget == after.peak else
                              _within(run, layers, options, ms, base.peak, budget, say))
        except NoFit:  # the options' measured savings do not add up to this budget: no point here
            continue
        ms["chosen"] = most_ms if budget == after.peak else ms["chosen"]
        key = (tuple(sorted(choice.items())), ms["chosen"])
        if key not in seconds_of:
            time, blocks = timed(model_text, batch, seq, mode, device, lora_r, choice, ms["chosen"])
            seconds_of[key] = modelled_time(time, blocks)
        curve.append({"budget": budget, "peak": got.peak, "seconds": seconds_of[key],
                      "error": max((options[layers[p]][o]["error"] for p, o in choice.items()), default=0.0),
                      "plan": _described(choice, ms["chosen"])})
    time, blocks, loss = move_costs(run, model_text, batch, seq, mode, lora_r, most, most_ms, after, device, say)
    itemsize = as_setup(mode).dtype.itemsize

    def moved(budget: int) -> dict | None:
        try:
            return plan_moves(after, time, blocks, budget, device, itemsize, loss)
        except ValueError:
            return None

    lo, hi = 0, after.peak  # the lowest budget the moves reach, to 1 %
    while hi - lo > after.peak // 100:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if moved(mid) else (mid, hi)
    error = max((options[layers[p]][o]["error"] for p, o in most.items()), default=0.0)
    for budget in _spread(after.peak, hi, points)[1:]:
        m = moved(budget)
        curve.append({"budget": budget, "peak": m["peak"], "seconds": m["seconds_after"], "error": error,
                      "plan": _described(most, most_ms) + "; " + ", ".join(
                          MOVED[k].format(n) for k, n in m["by_move"].items() if n)})
    return curve


MOVED = {"recompute": "{} blocks recomputed", "offload": "{} offloaded", "chunked-loss": "loss chunked"}


def _spread(high: int, low: int, points: int) -> list[int]:
    """``points`` budgets from ``high`` down to ``low``, evenly spaced."""
    return [round(high - (high - low) * i / (points - 1)) for i in range(points)]


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
    """Peak against modelled step time, each point coloured by its gradient-error bound (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    peaks = [c["peak"] / 2**30 for c in curve]
    ms = [1e3 * c["seconds"] for c in curve]
    ax.plot(ms, peaks, color="0.7", zorder=1)
    errors = [max(c["error"], 1e-9) for c in curve]
    dots = ax.scatter(ms, peaks, c=errors, cmap="viridis", norm=LogNorm(vmin=1e-9, vmax=max(1.0, max(errors))),
                      zorder=2)
    fig.colorbar(dots, ax=ax, label="gradient-error bound (exact plotted at 1e-9)")
    ax.set(xlabel="modelled step time (ms, roofline)", ylabel="modelled peak (GiB)")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(curve: list[dict], path: Path, meta: dict) -> Path:
    path.write_text(json.dumps({**meta, "curve": curve}, indent=1) + "\n", encoding="utf-8")
    return path

