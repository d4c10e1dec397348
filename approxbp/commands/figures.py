"""``approxbp figures``: every figure of the docs as PNG."""

from __future__ import annotations

import sys
from pathlib import Path

from approxbp.commands import common


def add_parser(sub, add) -> None:
    fig = add(sub, "figures", help="write every figure (ReLU-sum, InvAct, error atlas, BDIA) as PNG; the toy GPT "
              "is re-plotted from its committed JSON (`approxbp bdia train-toy` retrains)")
    common.out_arg(fig, "the PNGs")


def run(args, argv) -> int:
    from approxbp.approximations import tables as T
    from approxbp.approximations.files import save_figure
    from approxbp.fitting.atlas import write_atlas
    from approxbp.fitting.plots import plot_invact, plot_relu_sum

    args.out = common.figures_dir(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    written = write_atlas(args.out)
    for act in ("gelu", "silu"):
        f = plot_relu_sum(T.load(f"relu_sum/{T.relu_sum_name(act, 2, 'primitive')}"),
                          T.load(f"relu_sum/{T.relu_sum_name(act, 2, 'primitive', 'paper')}"),
                          x_range=(-6, 6) if act == "gelu" else (-10, 10))
        written.append(args.out / f"relu_sum_{act}_k2.png")
        save_figure(f, written[-1], dpi=110)
        f = plot_invact(act)
        written.append(args.out / f"invact_{act}.png")
        save_figure(f, written[-1], dpi=110)
    from approxbp import bdia_experiments as bdia

    written += bdia.write_analysis(args.out, progress=False)
    committed = Path(__file__).resolve().parents[2] / "docs" / "figures" / "bdia_toy_gpt.json"
    results = next((p for p in (args.out / "bdia_toy_gpt.json", committed) if p.is_file()), None)
    if results is None:
        print("no bdia_toy_gpt.json to re-plot: retraining the toy GPT (about 2–3 minutes on 2 cores)",
              file=sys.stderr)
    written += bdia.write_toy_gpt(args.out, results_json=results, progress=False)
    for p in written:
        print(f"wrote {p}")
    return 0
