"""Every figure of the docs as PNG (``approxbp figures``): the error atlas, the ReLU-sum and InvAct plots of GELU and
SiLU, the BDIA analysis, and the toy BDIA-GPT re-plotted from its results JSON (retrained when there is none)."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["figures_dir", "write_figures"]


#: The source checkout's docs/figures (where the figures are committed, the toy GPT's results beside them).
_CHECKOUT_FIGURES = Path(__file__).resolve().parents[2] / "docs" / "figures"


def figures_dir(out: Path | None) -> Path:
    """``out``, or the source checkout's docs/figures (never the current directory's by surprise)."""
    if out is not None:
        return out
    if _CHECKOUT_FIGURES.is_dir() and (_CHECKOUT_FIGURES.parents[1] / "pyproject.toml").is_file():
        return _CHECKOUT_FIGURES
    raise ValueError("pass --out DIR: this approxbp is not a source checkout with docs/figures")


def write_figures(out: Path) -> list[Path]:
    """Write every figure into the folder ``out``; returns the paths written."""
    from approxbp.approximations import tables as table_files
    from approxbp.approximations.files import save_figure
    from approxbp.fitting.atlas import write_atlas
    from approxbp.fitting.plots import plot_invact, plot_relu_sum
    from approxbp.papers import bdia_experiments as bdia

    out.mkdir(parents=True, exist_ok=True)
    written = write_atlas(out)
    for act in ("gelu", "silu"):
        f = plot_relu_sum(table_files.load(f"relu_sum/{table_files.relu_sum_name(act, 2, 'primitive')}"),
                          table_files.load(f"relu_sum/{table_files.relu_sum_name(act, 2, 'primitive', 'paper')}"),
                          x_range=(-6, 6) if act == "gelu" else (-10, 10))
        written.append(out / f"relu_sum_{act}_k2.png")
        save_figure(f, written[-1], dpi=110)
        f = plot_invact(act)
        written.append(out / f"invact_{act}.png")
        save_figure(f, written[-1], dpi=110)
    written += bdia.write_analysis(out, progress=False)
    candidates = (out / "bdia_toy_gpt.json", _CHECKOUT_FIGURES / "bdia_toy_gpt.json")
    results = next((p for p in candidates if p.is_file()), None)
    if results is None:
        print("no bdia_toy_gpt.json to re-plot: retraining the toy GPT (about 2–3 minutes on 2 cores)",
              file=sys.stderr)
    return written + bdia.write_toy_gpt(out, results_json=results, progress=False)
