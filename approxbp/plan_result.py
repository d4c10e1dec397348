"""A plan, what ``approxbp plan`` returns: its JSON (``--out``; :meth:`Plan.load`), applying it to a model
(:meth:`Plan.apply`), and its report as text and as a figure (the step's memory by category, before and after)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from torch import nn

from approxbp.step_memory import AT_PEAK, size


@dataclass
class Plan:
    model: str
    mode: str
    batch: int
    seq: int | None  # None: the model's inputs do not depend on it
    budget: int | None
    before: dict
    after: dict
    layers: dict[str, dict]  # path → {"activation", "option", "saving", "error"}
    options: dict[str, dict]  # activation → option → {"saving per layer", "error"}
    ms_norm: dict
    estimate: int | None = None  # the knapsack's additive prediction of the peak; ``after`` is measured
    checkpoint: bool = False  # activation checkpointing
    traced: bool = False  # a whole step traced (MemTracker) rather than the forward's saved tensors
    use: str | None = None  # the assignment evaluated (--use), or None: chosen by the planner
    moves: dict | None = None  # recompute/offload moves beyond the approximations (approxbp.plan_moves.plan_moves)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan ``approxbp plan --out`` wrote to ``path`` (refused in one line when it is not one)."""
        from approxbp.kernels.rewrite.plan_file import read_plan

        data = read_plan(str(path))
        if missing := [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]:
            raise ValueError(f"{path}: not a plan written by `approxbp plan --out` (no {', '.join(missing)})")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def apply(self, model: nn.Module, *, example_input=None, check: bool = True,
              module_filter_fn: Callable[[nn.Module, str], bool] | None = None, compile_backend="inductor"):
        """Patch ``model`` as planned: each planned layer's table (or exact), the gated MLPs of its ``glu`` layers
        fused, MS-norms as chosen (:func:`approxbp.kernels.patch_model`'s rules and proofs; the plan's paths match
        the model's as they are or as a suffix, so a peft-wrapped model takes its base model's plan), then its moves;
        a planned ``activation_memory_budget`` compiles the model in place with ``compile_backend`` at that budget
        (:func:`approxbp.compiled.budget_backend`). Returns the patch report; without ``example_input`` the planned
        fused GLUs are not applied, and it says so per layer."""
        from approxbp.kernels.rewrite.patch import patch_model
        from approxbp.kernels.rewrite.plan_file import plan_config

        config = plan_config({"layers": self.layers, "ms_norm": self.ms_norm}, model)
        report = patch_model(model, config=replace(config, module_filter_fn=module_filter_fn),
                             example_input=example_input, check=check)
        if self.moves and self.moves.get("compile"):
            from approxbp.compiled import budget_backend

            b = self.moves["compile"]["activation_memory_budget"]
            model.compile(backend=budget_backend(b, compile_backend))
            report.moves = [f"compiled in place, activation_memory_budget {b}"]
        elif self.moves:
            report.moves = self._apply_moves(model)
        return report

    def _apply_moves(self, model: nn.Module) -> list[str]:
        """The planned recompute/offload moves on ``model``'s blocks (a planned path matches as it is or as a suffix,
        as the layers do); a block the model lacks is refused in one line."""
        from approxbp.chunked_loss import LOSS
        from approxbp.moves import apply_moves

        paths = [n for n, _ in model.named_modules()]
        resolved = {}
        for planned, move in self.moves["moves"].items():
            if planned == LOSS:
                resolved[LOSS] = move
                continue
            found = [p for p in paths if p == planned or p.endswith("." + planned)]
            if len(found) != 1:
                raise ValueError(f"the plan moves block {planned!r}, which this model has {len(found)} times, not once")
            resolved[found[0]] = move
        apply_moves(model, resolved)
        return [f"{path}: {move}" for path, move in resolved.items()]


CATEGORIES = ("parameters", "gradients", "optimizer")


def _title(p: Plan, short: bool = False) -> str:
    return " · ".join([p.model.split(":")[0] if short else p.model,
                       p.mode + (" + checkpointing" if p.checkpoint else "") + (", traced" if p.traced else ""),
                       f"batch {p.batch}", *([f"seq {p.seq}"] if p.seq is not None else [])])


def report(p: Plan) -> str:
    """The plan as text: the step before and after by category, the options per activation, the choice."""
    lines = [_title(p) + (f" · budget {size(p.budget)}" if p.budget else ""),
             f"{'':<28}{'exact':>12}{'planned':>12}"]
    for key in (*CATEGORIES, "activations", "peak"):
        lines.append(f"  {key:<26}{size(p.before[key]):>12}{size(p.after[key]):>12}")
    if p.before.get("device_peaks"):
        before, after = (" + ".join(size(b) for b in side["device_peaks"]) for side in (p.before, p.after))
        lines.append(f"  {'per GPU (by blocks)':<26}exact {before}; planned {after} (their sum is the peak "
                     "above; the largest must fit one GPU)")
    if p.before.get("peak_moment"):
        lines.append(f"  {'peak reached in':<26}{p.before['peak_moment']} / {p.after['peak_moment']} (a traced step: "
                     "gradients and activations alive then)")
    for kind in sorted(set(p.before["activations_by_kind"]) | set(p.after["activations_by_kind"])):
        lines.append(f"    {kind:<24}{size(p.before['activations_by_kind'].get(kind, 0)):>12}"
                     f"{size(p.after['activations_by_kind'].get(kind, 0)):>12}")
    if p.before.get("block_units") is not None and p.after.get("block_units") is not None:
        lines.append(f"  {'one block, App. B units':<26}{p.before['block_units']:>12.3f}"
                     f"{p.after['block_units']:>12.3f}   ({p.before['block'] or 'the model'}: saved bytes / a 16-bit "
                     "[b, n, c] tensor)")
    if p.before.get("blocks_measured"):
        lines.append(f"  (its blocks are alike: measured at {' and '.join(map(str, p.before['blocks_measured']))} "
                     "blocks and extrapolated, approxbp/extrapolate.py)")
    if p.use is None:
        lines.append("options (saving of the peak per layer, measured in this graph; gradient error: "
                     "E_N(0,1)[(h̃′ − f′)²]^½ or InvAct's certified L∞):")
        for act, opts in p.options.items():
            lines.append("  " + act + ": " + ", ".join(f"{o} {size(v['saving_per_layer'])} / {v['error']:.2g}"
                                                      for o, v in opts.items()))
        lines.append(f"  MS-norms (all mergeable norms): {size(p.ms_norm['saving'])}, exact; "
                     f"{'chosen' if p.ms_norm['chosen'] else 'not chosen'}")
    else:
        lines.append(f"the given assignment (--use {p.use}); MS-norms {'on' if p.ms_norm['chosen'] else 'off'}; "
                     "gradient error per layer: E_N(0,1)[(h̃′ − f′)²]^½ or InvAct's certified L∞")
    chosen: dict[str, list[str]] = {}
    for path, layer in sorted(p.layers.items()):
        error = f" (error {layer['error']:.2g})" if p.use else ""
        chosen.setdefault(f"{layer['activation']} → {layer['option']}{error}", []).append(path)  # not a table
    lines.append("choice:" if p.use is None else "assignment:")
    lines += [f"  {what}: {len(paths)} layers ({paths[0]}{', …' if len(paths) > 1 else ''})"
              for what, paths in chosen.items()]
    return "\n".join(lines + _moves_lines(p.moves))


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


def _moves_lines(m: dict | None) -> list[str]:
    """The recompute/offload part of a plan, with the modelled times (a roofline for the named GPU: a model)."""
    if not m:
        return []
    if m.get("compile"):
        return [f"torch.compile at activation_memory_budget {m['compile']['activation_memory_budget']} (the fastest "
                f"plan within the budget: its partitioner recomputes the cheapest ops), applied by Plan.apply",
                f"  modelled peak {size(m['peak'])} (the assignment's measured peak with its eager saved bytes "
                f"replaced by the compiled step's {size(m['saved'])}; the backward's transient not modelled)",
                f"  modelled step time on {m['gpu']}: {1e3 * m['seconds_after']:.3g} ms (a roofline on fake tensors, "
                f"Inductor's fusion modelled, no host time: a model, not a measurement; constants: {m['gpu_source']})"]
    blocks = "; ".join(f"{move}: {_ranges([p for p, v in m['moves'].items() if v == move])}"
                       for move in ("recompute", "offload") if m["by_move"][move])
    chunked = m["by_move"].get("chunked-loss", 0)
    parts = sorted({v for v in m["moves"].values() if v.startswith("recompute ")})
    if parts:
        blocks += "; " + "; ".join(f"{v}: {_ranges([p for p, w in m['moves'].items() if w == v])}" for v in parts)
    return [f"moves beyond the approximations (no assignment alone reaches the budget; the assignment above and "
            f"these moves are the least modelled time that does, chosen jointly): "
            f"{m['by_move']['recompute']} blocks recomputed, {m['by_move'].get('recompute part', 0)} recomputed in "
            f"part, {m['by_move']['offload']} offloaded ({blocks})"
            + ("; the loss chunked (logits never materialised)" if chunked else ""),
            f"  modelled peak {size(m['peak'])} = end of forward {size(m['end_of_forward'])} + the largest "
            f"transient (a moved block back, or a chunk's logits) {size(m['transient'])}",
            f"  modelled step time on {m['gpu']}: {1e3 * m['seconds_before']:.3g} ms → "
            f"{1e3 * m['seconds_after']:.3g} ms "
            f"(a roofline on fake tensors, no host time: a model, not a measurement; constants: {m['gpu_source']})"]


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

    kinds = sorted(set(p.before["activations_by_kind"]) | set(p.after["activations_by_kind"]),
                   key=lambda k: COLOURS.get(k, 99))
    palette = matplotlib.colormaps["tab10"]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for i, step in enumerate((p.before, p.after)):
        bottom = 0.0
        for key in (*CATEGORIES, *kinds):
            v = (step[key] if key in CATEGORIES else step["activations_by_kind"].get(key, 0)) / 2**30
            ax.bar(i, v, bottom=bottom, color=palette(COLOURS.get(key, 7)), label=key if i == 0 else None, width=0.55)
            bottom += v
    before, after = p.before["peak"], p.after["peak"]
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
