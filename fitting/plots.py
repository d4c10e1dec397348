"""Figures for notebooks and docs: every plot is a tested package function, never notebook-only logic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from approxbp.approximations import ReLUSum, get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.invact import InvertedActivation
from approxbp.approximations.invact_forms import Form, branch_grid

__all__ = ["plot_invact", "plot_relu_sum", "relu_sum_error_vs_bits"]


def plot_relu_sum(table: dict, paper: dict | None = None, x_range=(-6.0, 6.0), who: tuple[str, str] | None = None):
    """h vs h̃, h' vs the 2^k-level step derivative (Approx-BP Figs. 3, 7, 8, for any table) and the error the
    backward makes, h̃′ − h′. Each legend says whose table it draws: ``who`` (default: "ours" for ``table``, the
    paper and its reference, or "your table", for the other)."""
    from matplotlib.figure import Figure

    act = get_activation(table.expression)
    x = np.linspace(*x_range, 4001)
    fig = Figure(figsize=(15, 4))
    (a, b, e) = fig.subplots(1, 3)
    a.plot(x, act.f(x), "k", lw=2, label=f"{table.activation} (forward, exact)")
    b.plot(x, act.df(x), "k", lw=2, label=f"{table.activation}′")
    e.axhline(0.0, color="k", lw=1)
    names = who or ("ours", None if paper is None else _whose(paper))
    for t, style, name in ((table, "C3", names[0]), (paper, "C0--", names[1])):
        if t is None:
            continue
        rs = ReLUSum(t.weights, t.knots)
        a.plot(x, rs(x), style, label=f"h̃ {name}, k={t.bits} (loss {t.loss:.3e})")
        b.plot(x, rs.derivative(x), style, label=f"h̃′ {name}: {2 ** t.bits} levels, used in backward")
        e.plot(x, rs.derivative(x) - act.df(x), style, label=f"h̃′ − h′, {name}")
    for ax, ylabel in ((a, "activation h(x)"), (b, "derivative"), (e, "backward error h̃′ − h′")):
        ax.set_xlabel("x")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"ReLU-sum approximation, {table.objective} objective")
    fig.tight_layout()
    return fig


def _whose(t) -> str:
    """A table's owner for a legend: the paper (its reference) or the user's file."""
    if t.source != "paper":
        return "your table"
    short = (t.reference or "").split(" (")[0].split(";")[0]  # "Approx-BP App. E.1"
    return f"paper, {short}" if short else "paper"


def relu_sum_error_vs_bits(activation: str, objective: str = "primitive", bits=range(1, 9), seed: int = 0,
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(k, loss): the committed table's loss for each k where the package has one (k = 1..8 for the registry's
    activations), else a fit made now (any activation or expression; :func:`.relu_sum.fit_relu_sum`, 2 restarts)."""
    from .relu_sum import fit_relu_sum

    ks, losses = np.array(list(bits)), []
    for k in ks:
        try:
            losses.append(table_files.load(f"relu_sum/{table_files.relu_sum_name(activation, int(k), objective)}").loss)
        except FileNotFoundError:
            fit = fit_relu_sum(activation, int(k), objective, restarts=2, seed=seed, workers=1, progress=False)
            losses.append(fit.table.loss)
    return ks, np.array(losses)


def _invact_tables(activation: str, forms, tables) -> list[tuple]:
    """(table, whose: its legend's owner) for the committed ``forms`` of ``activation`` that exist, then for the
    given tables (paths, dicts or tables: "yours", with the file's name)."""
    found = []
    for form in forms:
        try:
            t = table_files.load(f"invact/{activation}-{form}")
        except FileNotFoundError:
            continue
        found.append((t, f"{_whose(t)}: {form}" if t.source == "paper" else f"ours, packaged: {form}"))
    for t in tables:
        path = isinstance(t, str) or hasattr(t, "is_file")
        table = table_files.load(t) if path else table_files.as_table(t)
        found.append((table, f"yours{f' ({Path(str(t)).name})' if path else ''}: {table.form}"))
    return found


def plot_invact(activation: str, forms=("paper", "released", "newton"), tables=(), note: str = ""):
    """g(y) = f'(f⁻¹(y)) on both branches, and |g − q| for each committed form of ``activation`` and each of
    ``tables`` (a user's table, path or fit: Inverted Activations Fig. 2 for any activation). With no table, g
    alone, and ``note`` (why there is none: a fit's refusal) where the errors would be."""
    from matplotlib.figure import Figure

    from .invact_exact import is_monotone

    act = get_activation(activation)
    if is_monotone(act):  # one branch: the packaged exact table (softplus) and the given ones
        return _plot_monotone(act, _invact_tables(act.name, ("exact",), tables), note)
    ia = InvertedActivation(activation)
    shown = _invact_tables(ia.activation.name, forms, tables)
    fig = Figure(figsize=(11, 7))
    axes = fig.subplots(2, 2)
    for col, side in enumerate(("left", "right")):
        yv, _ = branch_grid(ia, side, 4001)
        yv = yv[1:-1]
        g = ia.g(yv, side)
        axes[0, col].plot(yv, g, "k", lw=2, label="g = f′∘f⁻¹ (exact)")
        for t, whose in shown:
            q = Form.from_table(getattr(t, side))(yv)
            axes[0, col].plot(yv, q, "--", label=whose)
            axes[1, col].semilogy(yv, np.abs(g - q) + 1e-18, label=f"{whose} (L∞ {t.metrics[f'linf_{side}']:.1e})")
        axes[0, col].set_title(f"{side} branch ({'x < T' if side == 'left' else 'x ≥ T'})")
        axes[1, col].set_xlabel("y = f(x)")
        axes[0, col].set_ylabel("f′(f⁻¹(y))")
        axes[1, col].set_ylabel("|g − q|")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3, which="both")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    if not shown:
        _no_table(axes[1, 0], ia.activation.name, forms, note)
    published = any(t.source == "paper" for t, _ in shown)
    fig.suptitle(f"Inverted {ia.activation.name}: {'published vs ours' if published else 'our forms'}")
    fig.tight_layout()
    return fig


def _no_table(ax, name: str, forms, note: str) -> None:
    """The error panel of a plot with no table: why there is none, and what to pass."""
    import textwrap

    text = note or (f"the package has none of {', '.join(forms)} for {name}: pass tables=[fit_invact(activation)"
                    ".table] or a table path")
    ax.text(0.02, 0.5, textwrap.fill(f"no table to compare: {text}", 70), transform=ax.transAxes, fontsize=8,
            va="center")


def _plot_monotone(act, shown: list, note: str = ""):
    """One branch (an increasing activation): g = f′ against y = f(x) over x ∈ [−30, 30], and |g − q| for each
    monotone table in ``shown`` (an exact table's error is float64 rounding)."""
    from matplotlib.figure import Figure

    xv = np.linspace(-30.0, 30.0, 4001)
    yv, g = act.f(xv), act.df(xv)
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    left.plot(yv, g, "k", lw=2, label="g = f′∘f⁻¹ (exact)")
    for t, whose in shown:
        q = Form.from_table(t.right)(yv)
        left.plot(yv, q, "--", label=f"{whose}: q = {t.right.expression}")
        right.semilogy(yv, np.abs(g - q) + 1e-18, label=f"{whose} (L∞ {t.metrics['linf_right']:.1e})")
    left.set_title("one branch: f increases, so y alone gives f′(f⁻¹(y)) (no bit)")
    for ax, label in ((left, "f′(f⁻¹(y))"), (right, "|g − q|")):
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlabel("y = f(x)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if not shown:
        _no_table(right, act.name, ("exact",), note)
    fig.suptitle(f"Inverted {act.name} (monotone)")
    fig.tight_layout()
    return fig
