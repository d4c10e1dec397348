"""``approxbp figures``: every figure of the docs as PNG."""

from __future__ import annotations

from approxbp.commands import common
from approxbp.papers.figures import figures_dir

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    fig = add(sub, "figures", help="write every figure (ReLU-sum, InvAct, error atlas, BDIA) as PNG; the toy GPT "
              "is re-plotted from its committed JSON (`approxbp bdia train-toy` retrains)")
    common.out_arg(fig, "the PNGs")


def run(args, argv) -> int:
    from approxbp.papers.figures import write_figures

    for p in write_figures(figures_dir(args.out)):
        print(f"wrote {p}")
    return 0
