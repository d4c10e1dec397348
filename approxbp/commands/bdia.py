"""``approxbp bdia analyze|train-toy``: BDIA's reconstruction error and a toy BDIA-GPT."""

from __future__ import annotations

import argparse
import json

from approxbp.commands import common
from approxbp.papers.figures import figures_dir

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    bd = add(sub, "bdia", help="BDIA reversible stacks: error analysis and a toy BDIA-GPT")
    bds = bd.add_subparsers(dest="action", required=True)
    ana = add(bds, "analyze", help="reconstruction error vs block (Fig. 2/6), forward quantisation, memory")
    ana.add_argument("--blocks", type=_int_in(2, 10**6), default=1000, help="K, the number of blocks (2…10⁶)")
    ana.add_argument("--level", type=_int_in(-60, 60), action="append", default=None,
                     help="quantisation level l, repeatable (None: -2 0 5 9 12)")
    ana.add_argument("--dtype", choices=("float32", "float64"), action="append", default=None,
                     help="repeatable (None: both)")
    ana.add_argument("--seed", type=int, default=0, help="seed of the random blocks and γ")
    common.out_arg(ana, "bdia_analysis.json/.png")
    common.no_progress(ana)
    toy = add(bds, "train-toy", help="standard vs BDIA training of a 6-block GPT toy on the CPU (minutes)")
    toy.add_argument("--steps", type=_int_in(1, 10**7), default=300, help="training steps per model")
    toy.add_argument("--level", type=_int_in(-60, 60), default=9, help="quantisation level l (−60…60)")
    toy.add_argument("--seed", type=int, default=0, help="seed of data, init and γ")
    common.out_arg(toy, "bdia_toy_gpt.json/.png")
    common.no_progress(toy)


def run(args, argv) -> int:
    progress = common.progress_on(args)

    import torch

    from approxbp.papers import bdia_experiments as bdia

    out = figures_dir(args.out)
    if args.action == "analyze":
        dtypes = tuple(getattr(torch, d) for d in (args.dtype or ("float32", "float64")))
        written = bdia.write_analysis(out, args.blocks, tuple(args.level or bdia.LEVELS), dtypes, args.seed,
                                      progress=progress)
        r = json.loads(written[0].read_text())
        print(f"max reconstruction error after {r['blocks']} blocks:")
        for key, v in r["reconstruction"].items():
            if "error" in v:  # beyond the exactness bound: the analysis records why, not a number
                print(f"  {key:<24} refused: {v['error'][:90]}")
                continue
            errs = v["max_error_by_block"]
            finite = [e for e in errs if e is not None]
            gone = next((i for i, e in enumerate(errs) if e is None), None)
            tail = f"overflows after {gone} blocks" if gone is not None else f"{(finite or [0])[-1]:.3e}"
            print(f"  {key:<24} {tail}")
        m = r["memory"]
        print(f"saved bytes per element per block: autograd {m['autograd_bytes_per_element_per_block']:.2f}, "
              f"online {m['online_bytes_per_element_per_block']:.2f}")
    else:
        written = bdia.write_toy_gpt(out, steps=args.steps, level=args.level, seed=args.seed,
                                     progress=progress)
        r = json.loads(written[0].read_text())
        for name in ("standard", "bdia"):
            print(f"{name:<9} final validation loss {r[name]['val_loss'][-1][1]:.4f}, saved activations "
                  f"{r[name]['saved_bytes_per_step'] / 2**20:.1f} MiB per step")
    for p in written:
        print(f"wrote {p}")
    return 0


def _int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi], refused in one line otherwise."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {lo}…{hi}")
        return v

    return parse
