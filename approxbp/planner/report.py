"""A plan's report: as text (:func:`report`, what ``approxbp plan`` prints) and as a figure (:func:`figure`, the
step's memory by category, before and after)."""

from __future__ import annotations

from pathlib import Path

from approxbp.planner.plan_parts import Moves
from approxbp.planner.result import Plan
from approxbp.planner.step_memory import AT_PEAK, size

__all__ = ["CATEGORIES", "COLOURS", "figure", "report"]


CATEGORIES = ("parameters", "gradients", "optimizer")


def _title(p: Plan, short: bool = False) -> str:
    return " · ".join([p.model.split(":")[0] if short else p.model,
                       p.mode + (" + checkpointing" if p.checkpoint else "") + (", traced" if p.traced else ""),
                       f"batch {p.batch}", *([f"seq {p.seq}"] if p.seq is not None else [])])


def report(p: Plan) -> str:
    """The plan as text: the step before and after by category, the options per activation, the choice."""
    steps = (p.before, *([p.assignment] if p.assignment else []), p.after)  # with moves: the assignment alone too
    default = p.moves is not None and p.moves.gpu_default
    lines = [_title(p) + (f" · budget {size(p.budget)}" if p.budget else "")
             + (f" · moves weighed on {p.moves.gpu}, the default GPU (--gpu NAME for another)" if default else ""),
             f"{'':<28}{'exact':>12}" + (f"{'approximated':>14}" if p.assignment else "") + f"{'planned':>12}"]
    if not (p.traced or p.after.peak_traced):  # the first number a user reads: say what it is, first
        lines.insert(1, "  (peak: modelled at the end of the forward, not the step's: the backward and the optimizer "
                        "step can reach well above it; --trace or --budget traces the whole step)")
    widths = (12, 14, 12) if p.assignment else (12, 12)
    for key in (*CATEGORIES, "activations", "peak"):
        lines.append(f"  {key:<26}" + "".join(f"{size(getattr(step, key)):>{w}}" for step, w in zip(steps, widths)))
    if p.assignment:
        lines.append(f"  {'':<26}(approximated: the approximations alone; planned: with the moves below)")
    lines.append(f"  {'':<26}({_which_peak(p)})")
    if p.before.device_peaks:
        before, after = (" + ".join(size(b) for b in side.device_peaks) for side in (p.before, p.after))
        lines.append(f"  {'per GPU (by blocks)':<26}exact {before}; planned {after} (their sum is the peak "
                     "above; the largest must fit one GPU)")
    if p.before.peak_moment:
        lines.append(f"  {'peak reached in':<26}{p.before.peak_moment} / {p.after.peak_moment} (a traced step: "
                     "gradients and activations alive then)")
    for kind in sorted({k for step in steps for k in step.activations_by_kind}):
        lines.append(f"    {kind:<24}" + "".join(f"{size(step.activations_by_kind.get(kind, 0)):>{w}}"
                                              for step, w in zip(steps, widths)))
    if p.before.block_units is not None and p.after.block_units is not None:
        lines.append(f"  {'one block, App. B units':<26}{p.before.block_units:>12.3f}"
                     f"{p.after.block_units:>12.3f}   ({p.before.block or 'the model'}: saved bytes / a 16-bit "
                     "[b, n, c] tensor)")
    if p.before.blocks_measured:
        lines.append(f"  (its blocks are alike: measured at {' and '.join(map(str, p.before.blocks_measured))} "
                     "blocks and extrapolated, approxbp/planner/extrapolate.py)")
    if p.use is None:
        lines.append("options (saving of the peak per layer, measured in this graph; gradient error: "
                     "E_N(0,1)[(h̃′ − f′)²]^½ or InvAct's certified L∞):")
        for act, opts in p.options.items():
            lines.append("  " + act + ": " + ", ".join(f"{o} {size(v.saving_per_layer)} / {v.error:.2g}"
                                                      for o, v in opts.items()))
        lines.append(f"  MS-norms (all mergeable norms): {size(p.ms_norm.saving)}, exact; "
                     f"{'chosen' if p.ms_norm.chosen else 'not chosen'}")
    else:
        lines.append(f"the given assignment (--use {p.use}); MS-norms {'on' if p.ms_norm.chosen else 'off'}; "
                     "gradient error per layer: E_N(0,1)[(h̃′ − f′)²]^½ or InvAct's certified L∞")
    chosen: dict[str, list[str]] = {}
    for path, layer in sorted(p.layers.items()):
        error = f" (error {layer.error:.2g})" if p.use else ""
        chosen.setdefault(f"{layer.activation} → {layer.option}{error}", []).append(path)  # not a table
    lines.append("choice:" if p.use is None else "assignment:")
    lines += [f"  {what}: {len(paths)} layers ({paths[0]}{', …' if len(paths) > 1 else ''})"
              for what, paths in chosen.items()]
    return "\n".join(lines + _moves_lines(p.moves))


def _which_peak(p: Plan) -> str:
    """Which peak the table's peak row is, per column."""
    return _which_traced(p) + (_RANK if p.shard > 1 and (p.traced or p.after.peak_traced) else "")


#: What a sharded traced peak is (approxbp.planner.step_memory.fsdp2_rank).
_RANK = ("; sharded: one rank's — the step traced on one device, its parameters, gradients and optimizer states "
         "sharded, plus FSDP2's gathered parameters (the root's, two blocks' and one block's gradients)")


def _which_traced(p: Plan) -> str:
    if p.after.peak_traced:
        exact = ("traced too: the plan is the exact step" if p.before.peak_traced else "traced too" if p.traced
                 else "the end of the forward with every gradient alive, modelled")
        return (f"peak: planned, a whole step traced by MemTracker on fake tensors (it peaks in "
                f"{p.after.peak_moment}), the number the budget is checked against; exact: {exact}")
    if p.traced:
        return "peak: a whole step traced by MemTracker on fake tensors"
    return ("peak: the end of the forward with every gradient alive, modelled (a whole step is traced with "
            "--budget, or --trace)")


def _ranges(paths: list[str]) -> str:
    """Block paths with runs of consecutive indices written once: model.layers.0–21, model.layers.25."""
    runs: list[list] = []
    for path in paths:
        stem, _, index = path.rpartition(".")
        if index.isdigit() and runs and runs[-1][0] == stem and runs[-1][2] == int(index) - 1:
            runs[-1][2] = int(index)
        else:
            runs.append([stem, int(index) if index.isdigit() else index, int(index) if index.isdigit() else index])
    return ", ".join((f"{stem}.{a}" if stem else f"{a}") + (f"–{b}" if b != a else "") for stem, a, b in runs)


def _moves_lines(m: Moves | None) -> list[str]:
    """The recompute/offload part of a plan, with the modelled times (a roofline for the named GPU: a model)."""
    if m is None:
        return []
    if m.compile is not None:
        return [f"torch.compile at activation_memory_budget {m.compile.activation_memory_budget} (the fastest "
                f"plan within the budget: its partitioner recomputes the cheapest ops), applied by Plan.apply",
                f"  modelled peak {size(m.peak)} (the assignment's measured peak with its eager saved bytes "
                f"replaced by the compiled step's {size(m.saved)}; the backward's transient not modelled)",
                f"  modelled step time on {m.gpu}: {1e3 * m.seconds_after:.3g} ms (a roofline on fake tensors, "
                f"Inductor's fusion modelled, no host time: a model, not a measurement; constants: {m.gpu_source})"]
    blocks = "; ".join(f"{move}: {_ranges([p for p, v in m.moves.items() if v == move])}"
                       for move in ("recompute", "offload") if m.by_move[move])
    parts = sorted({v for v in m.moves.values() if v.startswith("recompute ")})
    if parts:
        blocks += "; " + "; ".join(f"{v}: {_ranges([p for p, w in m.moves.items() if w == v])}" for v in parts)
    return [f"moves beyond the approximations (no assignment alone reaches the budget; the assignment above and "
            f"these moves are the least modelled time that does, chosen jointly): "
            f"{m.by_move['recompute']} blocks recomputed, {m.by_move.get('recompute part', 0)} recomputed in "
            f"part, {m.by_move['offload']} offloaded ({blocks})"
            + ("; the loss chunked (logits never materialised)" if m.chunks_loss else ""),
            f"  modelled peak {size(m.peak)} = end of forward {size(m.end_of_forward)} + the largest "
            f"transient (a moved block back, or a chunk's logits) {size(m.transient)}",
            f"  modelled step time on {m.gpu}: {1e3 * m.seconds_before:.3g} ms → "
            f"{1e3 * m.seconds_after:.3g} ms "
            f"(a roofline on fake tensors, no host time: a model, not a measurement; constants: {m.gpu_source})"]


#: One colour per category in every figure (tab10's), so that two plans' figures read alike.
COLOURS = {"parameters": 0, "gradients": 1, "optimizer": 2, "activation functions": 3, "norms": 4,
           "linear / embedding inputs": 5, "attention": 6, "MLP products (SwiGLU)": 8, "other": 7, AT_PEAK: 9}


def figure(p: Plan, path: Path) -> Path:
    """Stacked bars of the step's memory by category, exact and planned (as Approx-BP's Fig. 2): fixed colours per
    category, the budget as a line, the saving written over the planned bar."""
    import io
    import textwrap

    import matplotlib
    from matplotlib.figure import Figure

    from approxbp.approximations.files import write_atomic

    kinds = sorted(set(p.before.activations_by_kind) | set(p.after.activations_by_kind),
                   key=lambda k: COLOURS.get(k, 99))
    palette = matplotlib.colormaps["tab10"]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for i, step in enumerate((p.before, p.after)):
        bottom = 0.0
        for key in (*CATEGORIES, *kinds):
            v = (getattr(step, key) if key in CATEGORIES else step.activations_by_kind.get(key, 0)) / 2**30
            ax.bar(i, v, bottom=bottom, color=palette(COLOURS.get(key, 7)), label=key if i == 0 else None, width=0.55)
            bottom += v
    before, after = p.before.peak, p.after.peak
    saved = before - after
    note = (f"−{size(saved)} ({-100 * saved / before:.0f} %)" if saved > 0 else
            "the exact step fits the budget:\nnothing replaced" if p.budget and before <= p.budget else "no saving")
    ax.annotate(note, (1, after / 2**30), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                fontsize=9)
    if p.budget:
        ax.axhline(p.budget / 2**30, color="black", linestyle="--", linewidth=1, label=f"budget {size(p.budget)}")
    ax.set_ylim(0, max(before, after, p.budget or 0) / 2**30 * 1.15)
    ax.set_xticks([0, 1], ["exact", "planned" if p.use is None else f"--use {p.use}"[:24]])
    ax.set_ylabel("GiB")
    ax.set_title("\n".join(textwrap.wrap(_title(p, short=True), 64)), fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return write_atomic(Path(path), buf.getvalue())
