"""Every figure of the docs as PNG (``approxbp figures``): the error atlas, the ReLU-sum and InvAct plots of GELU and
SiLU, the BDIA analysis, and the toy BDIA-GPT re-plotted from its results JSON (retrained when there is none)."""

from __future__ import annotations

import sys
from pathlib import Path

#: The toy GPT's committed results (a source checkout's), re-plotted rather than retrained.
COMMITTED_TOY_GPT = Path(__file__).resolve().parent.parent / "docs" / "figures" / "bdia_toy_gpt.json"


def write_figures(out: Path) -> list[Path]:
    """Write every figure into the folder ``out``; returns the paths written."""
    from approxbp import bdia_experiments as bdia
    from approxbp.approximations import tables as T
    from approxbp.approximations.files import save_figure
    from approxbp.fitting.atlas import write_atlas
    from approxbp.fitting.plots import plot_invact, plot_relu_sum

    out.mkdir(parents=True, exist_ok=True)
    written = write_atlas(out)
    for act in ("gelu", "silu"):
        f = plot_relu_sum(T.load(f"relu_sum/{T.relu_sum_name(act, 2, 'primitive')}"),
                          T.load(f"relu_sum/{T.relu_sum_name(act, 2, 'primitive', 'paper')}"),
                          x_range=(-6, 6) if act == "gelu" else (-10, 10))
        written.append(out / f"relu_sum_{act}_k2.png")
        save_figure(f, written[-1], dpi=110)
        f = plot_invact(act)
        written.append(out / f"invact_{act}.png")
        save_figure(f, written[-1], dpi=110)
    written += bdia.write_analysis(out, progress=False)
    results = next((p for p in (out / "bdia_toy_gpt.json", COMMITTED_TOY_GPT) if p.is_file()), None)
    if results is None:
        print("no bdia_toy_gpt.json to re-plot: retraining the toy GPT (about 2–3 minutes on 2 cores)",
              file=sys.stderr)
    return written + bdia.write_toy_gpt(out, results_json=results, progress=False)
