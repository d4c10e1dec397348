"""``approxbp``: one entry point, thin subcommands over the Python API.

    approxbp fit relu-sum --activation NAME_OR_EXPR --bits K [--objective ...] [--method ...] [--out PATH]
    approxbp reproduce [--full] [--seed S] [--restarts N] [--workers N]
    approxbp export [TABLE ...] [--out-dir DIR]   generate Triton kernels from tables
    approxbp tables [--family F]          list and validate the committed tables
    approxbp bdia analyze [--blocks K] [--level L ...] [--dtype D ...] [--out DIR]
    approxbp bdia train-toy [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

#: fitting.invact.FORMS (the CLI imports no fitting code to build its parser; a test keeps the two equal).
INVACT_FORMS = ("auto", "paper", "released", "refit-l2", "refit-linf", "newton", "sr", "fast", "exact")


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


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="root seed; restarts use independent child seeds")
    p.add_argument("--restarts", type=int, default=4, help="seeded restarts of the method (structured starts and "
                   "a knot-relocation pass come on top)")
    p.add_argument("--workers", type=int, default=None, help="processes for restarts (None: all cores)")
    _no_progress(p)


def _table_paths_arg(p: argparse.ArgumentParser, none: str, name: str = "tables") -> None:
    """The positional table paths of a subcommand; ``none`` says what it takes when none is given."""
    p.add_argument(name, nargs="*", type=Path, help=f"table paths (none: {none})")


def _no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress (bars on a terminal, lines in a log)")


def _out(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for {what} (None: docs/figures of the source checkout; elsewhere required)")


def _parser_fit(sub, add) -> None:
    from approxbp.fitting.relu_sum import METHODS

    fit = add(sub, "fit", help="fit an approximation family and write a coefficient table")
    fam = fit.add_subparsers(dest="family", required=True)
    rs = add(fam, "relu-sum", help="sum of 2^k−1 ReLUs (Approx-BP eq. 13)")
    rs.add_argument("--activation", required=True, help="registry name or an expression in x")
    rs.add_argument("--name", default=None, help="a label for an expression (tables, reports, file names); "
                    "None: the expression itself")
    rs.add_argument("--bits", type=int, required=True, help="k: 2^k−1 ReLUs, k-bit codes (1..8)")
    rs.add_argument("--objective", choices=("primitive", "derivative"), default=None,
                    help="primitive: ∫(h−h̃)² (eq. 14); derivative: ∫(h'−h̃')² (eq. 63). Default: primitive, "
                    "derivative with --levels free")
    rs.add_argument("--levels", choices=("constrained", "free"), default="constrained",
                    help="constrained: eq. 13 (Σw = 1, Σw·c = 0, the interval by the tail rule); free: FewBit's "
                    "family (every level free, uniform weight on --interval; derivative objective only)")
    rs.add_argument("--interval", type=float, nargs=2, metavar=("A", "B"), default=None,
                    help="the domain: with --levels free FewBit's -100 100 by default; constrained: in place of the "
                    "tail rule's interval (the mass outside it is reported in the table, not fitted)")
    rs.add_argument("--method", choices=("auto", *METHODS), default="auto",
                    help="auto = anneal for k ≤ 4, polish above; every method ends in the certified polish")
    rs.add_argument("--out", type=Path, default=None, help="table path (None: print only)")
    rs.add_argument("--force", action="store_true", help="with --out: replace an existing file")
    _add_common(rs)

    inv = add(fam, "invact", help="f'∘f⁻¹ for inverted activations (Inverted Activations §2)")
    inv.add_argument("--activation", required=True, help="registry name or an expression in x")
    inv.add_argument("--name", default=None, help="a label for an expression (tables, reports, file names); "
                     "None: the expression itself")
    inv.add_argument("--form", default="auto", choices=INVACT_FORMS,
                     help="auto: exact where it applies, else fast; fast: ours for kernels (≤ 1e-6, one √ and one "
                          "log); newton: ours, the accuracy reference; paper/released: published (gelu, silu); "
                          "refit-*: their forms refitted; sr: symbolic regression; exact: derived in closed form for "
                          "an increasing activation (one branch, no bit: softplus q = 1 − e^(−y)) or one flat left of "
                          "0 (relu2: q = 2√y)")
    inv.add_argument("--backend", choices=("pyoperon", "pysr"), default="pyoperon", help="with --form sr")
    inv.add_argument("--sr-generations", type=int, default=150,
                     help="with --form sr: generations per branch (a count, not a time, so the result is reproducible)")
    inv.add_argument("--seed", type=int, default=0, help="with --form sr: the search's seed")
    inv.add_argument("--out", type=Path, default=None, help="table path (None: print only)")
    inv.add_argument("--force", action="store_true", help="with --out: replace an existing file")
    _no_progress(inv)


def _parser_sweep(sub, add) -> None:
    swp = add(sub, "sweep", help="fit ReLU-sum tables for several activations × bit-widths × objectives, with a "
              "summary table")
    swp.add_argument("--activation", action="append", required=True,
                     help="repeatable: a registry name or an expression (label it with NAME=EXPR)")
    swp.add_argument("--bits", default="1-4", help="bit-widths: a range 1-4 and/or a list 2,3,5")
    swp.add_argument("--objective", choices=("primitive", "derivative", "both"), default="primitive",
                     help="the objective(s) to fit")
    swp.add_argument("--out-dir", type=Path, default=None, help="write every table here (None: print only)")
    swp.add_argument("--force", action="store_true", help="with --out-dir: replace existing tables")
    _add_common(swp)


def _parser_reproduce(sub, add) -> None:
    rep = add(sub, "reproduce", help="regenerate the papers' rows and print paper vs ours")
    rep.add_argument("--full", action="store_true", help="also regenerate every committed table and check their "
                     "consistency across k and activations")
    rep.add_argument("--out", type=Path, default=None, help="with --full: table folder (None: packaged data)")
    rep.add_argument("--memory", action="store_true", help="also every memory row of Approx-BP Tables 1–4, 9, 11 "
                     "and InvAct App. A.1, each as the `approxbp plan` command that produces it (6 min, 2 cores)")
    _add_common(rep)


def _parser_export(sub, add) -> None:
    exp = add(sub, "export", help="generate Triton kernel modules from relu-sum and invact tables")
    _table_paths_arg(exp, "every packaged relu-sum and invact table, into the package")
    exp.add_argument("--out-dir", type=Path, default=None,
                     help="None: the package's kernels/generated/ for packaged tables, <table folder>/_generated/ "
                          "for your own (where ReLUSumActivation/InvActivation look for them)")


def _parser_figures(sub, add) -> None:
    fig = add(sub, "figures", help="write every figure (ReLU-sum, InvAct, error atlas, BDIA) as PNG; the toy GPT "
              "is re-plotted from its committed JSON (`approxbp bdia train-toy` retrains)")
    _out(fig, "the PNGs")


def _parser_atlas(sub, add) -> None:
    atl = add(sub, "atlas", help="error atlas: backward error vs saved bits for every family (JSON + PNG)")
    atl.add_argument("--activation", action="append", default=None,
                     help="repeatable; any registry name or expression (None: gelu and silu). Missing tables are "
                          "fitted once, with a note, and kept in OUT/atlas_tables for the next atlas")
    atl.add_argument("--name", action="append", default=None,
                     help="repeatable: a label for each --activation expression, in order (titles, file names)")
    _out(atl, "error_atlas.json and the PNGs")
    _no_progress(atl)


def _parser_bdia(sub, add) -> None:
    bd = add(sub, "bdia", help="BDIA reversible stacks: error analysis and a toy BDIA-GPT")
    bds = bd.add_subparsers(dest="action", required=True)
    ana = add(bds, "analyze", help="reconstruction error vs block (Fig. 2/6), forward quantisation, memory")
    ana.add_argument("--blocks", type=_int_in(2, 10**6), default=1000, help="K, the number of blocks (2…10⁶)")
    ana.add_argument("--level", type=_int_in(-60, 60), action="append", default=None,
                     help="quantisation level l, repeatable (None: -2 0 5 9 12)")
    ana.add_argument("--dtype", choices=("float32", "float64"), action="append", default=None,
                     help="repeatable (None: both)")
    ana.add_argument("--seed", type=int, default=0, help="seed of the random blocks and γ")
    _out(ana, "bdia_analysis.json/.png")
    _no_progress(ana)
    toy = add(bds, "train-toy", help="standard vs BDIA training of a 6-block GPT toy on the CPU (minutes)")
    toy.add_argument("--steps", type=_int_in(1, 10**7), default=300, help="training steps per model")
    toy.add_argument("--level", type=_int_in(-60, 60), default=9, help="quantisation level l (−60…60)")
    toy.add_argument("--seed", type=int, default=0, help="seed of data, init and γ")
    _out(toy, "bdia_toy_gpt.json/.png")
    _no_progress(toy)


def _parser_cost(sub, add) -> None:
    cst = add(sub, "cost", help="GPU cost of the generated kernels without a GPU: compile for sm_90 offline, count "
              "SASS instructions per element against the H100 budget (≈ 10.45 per byte moved)")
    _table_paths_arg(cst, "every packaged one, the MS-norms, BDIA, the exact GLUs and the torch-like GELU/SiLU")
    cst.add_argument("--arch", default="sm_90", help="the target, sm_NN")
    cst.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp64"), help="the activation dtype")
    cst.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    _no_progress(cst)


#: approxbp.tasks.TASKS's names (the parser imports no torch; a test checks they agree).
TASK_NAMES = ("base", "causal-lm", "masked-lm", "seq-cls", "token-cls", "qa", "image-cls", "audio-cls", "clip")


def _parser_plan(sub, add) -> None:
    pln = add(sub, "plan", help="a training step's memory measured on fake tensors (no hardware, no weights) and a "
              "replacement per layer: exact, ReLU-sum k = 1…4, InvAct, MS-norms, chosen under --budget")
    pln.add_argument("model", help="a Hugging Face config JSON file, the hub id of a config shipped with approxbp "
                     "(the papers' models: google/vit-base-patch16-224-in21k, huggyllama/llama-7b, …), or a model "
                     "type, each optionally with :key=value,… overrides "
                     "(llama:hidden=4096,layers=32,heads=32,intermediate=11008,vocab=32000); or "
                     "module:package.module:factory")
    pln.add_argument("--batch", type=int, default=1, help="batch size")
    pln.add_argument("--seq", type=int, default=512, help="sequence length (text models)")
    pln.add_argument("--mode", default="bf16", choices=("bf16", "autocast", "lora", "compile"),
                     help="bf16 weights; fp32 weights under bf16 autocast; frozen bf16 weights with LoRA adapters; "
                     "bf16 under torch.compile (inductor's partitioner)")
    pln.add_argument("--checkpoint", action="store_true", help="activation checkpointing on top of --mode (each "
                     "block recomputed in backward; the whole step is traced by PyTorch's MemTracker)")
    pln.add_argument("--trace", action="store_true", help="trace a whole step (forward, backward, AdamW) with "
                     "MemTracker for the true peak and its moment, rather than the forward's saved tensors")
    pln.add_argument("--lora-r", type=int, default=8, help="LoRA rank (with --train lora or --mode lora)")
    setup = pln.add_argument_group("the set-up, option by option (each overrides --mode's preset)")
    setup.add_argument("--weights", choices=("fp32", "bf16", "fp16", "nf4"), default=None,
                       help="stored weight dtype; nf4: the frozen base Linears in QLoRA's 4-bit NF4 with double-"
                            "quantised absmax, computing in bf16")
    setup.add_argument("--autocast", choices=("off", "bf16", "fp16"), default=None, help="the forward's autocast")
    setup.add_argument("--train", choices=("full", "lora", "lora-fa", "none"), default=None,
                       help="what trains: every parameter, LoRA adapters on a frozen base (peft's layout: fp32 "
                            "adapters on a 16-bit base), LoRA-FA (A frozen: only B trains), or nothing")
    setup.add_argument("--adapters", choices=("auto", "fp32", "bf16", "fp16"), default=None,
                       help="the LoRA adapters' dtype (auto: peft's "
                       "default, fp32 on a 16-bit base; QLoRA's script casts them to bf16)")
    setup.add_argument("--norms", choices=("auto", "fp32"), default=None, help="the norms' weights: the weights' "
                       "dtype, or fp32 as QLoRA's script keeps them (a 16-bit input times them is fp32)")
    setup.add_argument("--task", choices=TASK_NAMES, default=None, help="the head and its loss (default: the "
                       "config's architectures, else causal-lm, or image-cls for a vision config)")
    setup.add_argument("--lora-targets", default=None, help="comma-separated Linear names, or all-linear (every "
                       "Linear but the output head); default: the attention query and value")
    setup.add_argument("--optimizer", choices=("adamw", "adamw-8bit", "paged-adamw", "sgd"), default=None,
                       help="its state: AdamW's two moments (the parameters' dtype), bitsandbytes' 8-bit moments, "
                       "its paged AdamW's fp32 moments (QLoRA's; counted as resident), or none (plain SGD)")
    setup.add_argument("--compile", action="store_true", help="torch.compile (inductor's partitioner)")
    setup.add_argument("--shard", type=int, default=None, help="ranks that shard parameters, gradients and "
                       "optimizer states (FSDP2 / ZeRO-3); activations are per rank")
    pln.add_argument("--budget", default=None, help="peak memory to fit, e.g. 24GiB (none: save the most)")
    pln.add_argument("--maximize", choices=("batch", "seq_len"), default=None,
                     help="find the largest batch or sequence length that fits --budget (the plan is for it)")
    pln.add_argument("--grain", type=int, default=64, help="--maximize seq_len searches multiples of this many tokens")
    pln.add_argument("--use", default=None, help="evaluate this assignment instead of choosing one: exact, "
                     "relu-sum-k1…k4 or invact for every activation layer, each optionally +ms-norm (or ms-norm "
                     "alone), or a plan JSON (--out of an earlier plan); with --maximize, the largest size it fits")
    pln.add_argument("--out", type=Path, default=None, help="write the plan as JSON here (patch_model(plan=…))")
    pln.add_argument("--figure", type=Path, default=None, help="write the memory figure (PNG) here")
    _no_progress(pln)


def _parser_certify(sub, add) -> None:
    cer = add(sub, "certify", help="rigorous error bounds (interval arithmetic, python-flint): InvAct forms' sup error "
              "over each branch, ReLU-sum objectives and global optimality for k ≤ 2")
    _table_paths_arg(cer, "the packaged InvAct fast/newton tables and the gelu/silu ReLU-sum tables with k ≤ 2")
    cer.add_argument("--budget", type=float, default=600.0,
                     help="seconds per certificate (a branch, or a B&B); InvAct branches also stop at 300 000 boxes, "
                          "so a stored certificate does not depend on the machine")
    cer.add_argument("--max-boxes", type=int, default=None,
                     help="a work budget: boxes bounded per certificate (default: 300 000 for InvAct branches, "
                          "none for a ReLU-sum B&B); the same answer on any machine, whatever its load")
    cer.add_argument("--rtol", type=float, default=0.02,
                     help="InvAct: refine until the bound is within this factor of the error attained")
    cer.add_argument("--write", action="store_true", help="store the certificates in the tables' metrics "
                     "(then run `approxbp export` for their kernels)")
    cer.add_argument("--kernel-constants", action="store_true", help="InvAct: round the form's numbers to float32 "
                     "first, as the kernels write them (nothing is stored)")
    _no_progress(cer)


def _parser_tables(sub, add) -> None:
    tab = add(sub, "tables", help="list and validate coefficient tables (the packaged ones, or the files given)")
    _table_paths_arg(tab, "the packaged ones; yours are validated", name="files")
    tab.add_argument("--family", default=None, choices=("relu-sum", "invact"), help="only this family")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="approxbp", description=__doc__.split("\n")[0], formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"approxbp {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(parent, name, **kw):
        return parent.add_parser(name, formatter_class=fmt, **kw)

    for add_parser, _ in COMMANDS.values():
        add_parser(sub, add)
    return parser


def _version() -> str:
    from approxbp.fitting.relu_sum import package_version

    return package_version()


def _figures_dir(out: Path | None) -> Path:
    """``--out``, or the source checkout's docs/figures (never the current directory's by surprise)."""
    if out is not None:
        return out
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "docs" / "figures").is_dir() and (checkout / "pyproject.toml").is_file():
        return checkout / "docs" / "figures"
    raise ValueError("pass --out DIR: this approxbp is not a source checkout with docs/figures")


def _summary(t) -> str:
    """The one-screen summary of a fitted ReluSumTable."""
    m = t.metrics
    lines = [
        f"{t.family} · {t.activation} · k={t.bits} · objective={t.objective} · "
        f"interval=[{t.interval[0]:.6g}, {t.interval[1]:.6g}]",
        f"  expression  {t.expression}",
        f"  loss        {t.loss:.15e}   (tail mass outside interval {m['tail_mass']:.2e})",
        f"  knots       {_short(t.knots, 8)}",
        f"  weights     {_short(t.weights, 8)}",
        f"  levels      {_short(t.levels, 6)}",
        f"  constraints max(|Σw−1|, |Σw·c|) = {t.constraint_residual:.2e}",
        f"  certificate |∇J|∞ = {m['grad_inf_norm']:.2e}, λ_min(∇²J) = {m.get('hessian_min_eig', float('nan')):.3e}",
        f"  provenance  {t.provenance['method']}, seed {t.provenance['seed']}, "
        f"{t.provenance['restarts']} restarts, {t.provenance['seconds']:.2f} s",
    ]
    return "\n".join(lines)


def _short(values, precision: int) -> str:
    """An array on at most two lines (k ≥ 5 tables are summarised: first and last entries; the table has all)."""
    return np.array2string(np.array(values), precision=precision, max_line_width=100, threshold=16, edgeitems=3)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][1](args, argv)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        print(f"approxbp: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # files are written atomically: an interrupted command leaves none half-written
        print("approxbp: interrupted (files are written whole or not at all)", file=sys.stderr)
        return 130


def _progress(args) -> bool:
    return not getattr(args, "no_progress", False)


def _fit(args, argv) -> int:
    """``approxbp fit relu-sum|invact``: one table, summarised; written to --out (checked before the fit)."""
    from approxbp.approximations.files import check_writable

    if args.out is not None:  # fail now, not after a long fit
        check_writable(args.out, overwrite=args.force)
    if args.family == "invact":
        return _fit_invact(args, argv)
    return _fit_free_levels(args, argv) if args.levels == "free" else _fit_relu_sum(args, argv)


def _fit_relu_sum(args, argv) -> int:
    from approxbp.approximations import tables as T
    from approxbp.approximations.activations import named_activation
    from approxbp.fitting.relu_sum import cli_command, fit_relu_sum

    progress = _progress(args)
    args.objective = args.objective or "primitive"
    fit = fit_relu_sum(named_activation(args.activation, args.name), args.bits, args.objective,
                       method=args.method, restarts=args.restarts, seed=args.seed, workers=args.workers,
                       progress=progress, command=cli_command(argv), interval=args.interval)
    table = fit.table
    print(_summary(table))
    print(f"  restarts    {fit.message}")
    if fit.untrusted:
        print(f"approxbp: warning: only 1 of {len(fit.restarts)} restarts reached the best loss; "
              "run more --restarts before trusting this optimum", file=sys.stderr)
    if args.out:
        print(f"  wrote       {T.save(table, args.out, overwrite=args.force)}")
    return 0


def _fit_invact(args, argv) -> int:
    from approxbp.approximations import tables as T
    from approxbp.approximations.activations import named_activation

    progress = _progress(args)
    from approxbp.fitting.invact import fit_invact

    table = fit_invact(named_activation(args.activation, args.name), args.form, seed=args.seed,
                       backend=args.backend,
                       sr_generations=args.sr_generations, progress=progress).table
    m = table.metrics
    print(f"invact · {table.activation} · form={table.form} · "
          + ("monotone: one branch, no bit · inf f = " if table.monotone else
             f"T={table.turning_point:.17g} · f(T)=") + f"{table.f_T:.17g}")
    for side in table.branches:
        q = textwrap.shorten(getattr(table, side).expression, 70, placeholder=" …")  # cut at a space, not mid-token
        print(f"  {side:<5} L∞ {m[f'linf_{side}']:.3e}  L2 {m[f'l2_{side}']:.3e}  "
              f"{getattr(table, side).operations} operations  q = {q}")
    for branch in [b for b in ("left", "right") if f"pareto_{b}" in m]:
        print(f"  Pareto front ({branch}; pick one with approxbp.fitting.symbolic.pick_form):")
        for i, e in enumerate(m[f"pareto_{branch}"]):
            print(f"    [{i:2}] complexity {e['complexity']:3}  L∞ {e['linf']:.3e}  "
                  f"{textwrap.shorten(e['expression'], 80, placeholder=' …')}")  # Pareto entry, not a table
    if args.out:
        print(f"  wrote {T.save(table, args.out, overwrite=args.force)}")
    return 0


def _reproduce(args, argv) -> int:
    """``approxbp reproduce [--full]``: every paper row next to ours, one verdict line; exit 1 on a failed row."""
    from approxbp.reproduce import verdict

    t0, progress = time.perf_counter(), _progress(args)
    verdicts = _paper_rows(args, progress)  # (label, ok) per row
    if args.full:
        verdicts += _regenerate_all(args, progress)
    verdicts += _peer_rows(args)
    if args.memory:
        verdicts += _memory_rows(progress)
    ok, line = verdict(verdicts)
    print(f"reproduce finished in {time.perf_counter() - t0:.1f} s: {line}")
    return 0 if ok else 1


def _paper_rows(args, progress: bool) -> list[tuple[str, bool]]:
    """Approx-BP's ReLU-sum rows and Inverted Activations' branches: ours must be ≤ the paper's, and our newton
    forms 10× more accurate than every published one."""
    from approxbp.reproduce import (
        format_comparisons,
        format_invact_rows,
        invact_verdicts,
        reproduce_invact,
        reproduce_relu_sum,
    )

    rows = reproduce_relu_sum(seed=args.seed, restarts=args.restarts, workers=args.workers, progress=progress)
    print("Approx-BP ReLU-sum rows (k = 2): objective of the paper's coefficients vs our fit")
    print(format_comparisons(rows))
    inv = reproduce_invact()
    print("\nInverted Activations rows: published forms vs ours (newton), per branch")
    print(format_invact_rows(inv))
    return [(r.label, r.ok) for r in rows] + invact_verdicts(inv)


def _memory_rows(progress: bool) -> list[tuple[str, bool]]:
    """The papers' memory rows: planner vs paper; a row holds when within the targets or explained by a measured
    cause (approxbp.paper_memory)."""
    from approxbp import paper_memory as M

    tell = (lambda msg: print(f"[memory] {msg}", file=sys.stderr, flush=True)) if progress else None
    rows = M.reproduce(progress=tell)
    print(f"\nThe papers' memory rows: paper vs `approxbp plan` (targets: absolute within {M.ABSOLUTE:.0%} for "
          f"Tables 1–2, changes within {M.POINTS:.0f} points; commands: docs/memory.md)")
    print(M.text(rows))
    return [(f"{r.group.table}, {r.group.setup}, {M.METHODS[r.use]}", r.within or bool(r.explanation)) for r in rows]


def _regenerate_all(args, progress: bool) -> list[tuple[str, bool]]:
    """``--full``: every committed table refitted, their consistency across k and activations, certificates."""
    from approxbp.approximations import tables as T
    from approxbp.fitting.consistency import check_consistency
    from approxbp.reproduce import regenerate_invact, regenerate_tables

    paths = regenerate_tables(args.out, seed=args.seed, restarts=args.restarts, workers=args.workers,
                              progress=progress)
    paths += regenerate_invact(args.out, seed=args.seed)
    root = paths[0].parent.parent
    print(f"regenerated {len(paths)} tables under {root}")
    problems = check_consistency(lambda name: T.load(root / f"{name}.json"))
    print("consistency across k and activations: " + ("ok" if not problems else "FAILED"))
    for p in problems:
        print(f"  {p}")
    return [("consistency", not problems), ("certificates", _certify_regenerated(paths, progress))]


def _peer_rows(args) -> list[tuple[str, bool]]:
    """BDIA's exact reconstruction (Fig. 2), FewBit's builtin tables on their own objective, Approx-BP App. B."""
    from approxbp.appendix_b import format_rows, measure_all
    from approxbp.bdia_experiments import reproduce_row
    from approxbp.reproduce import bdia_verdict, format_fewbit_rows, reproduce_fewbit

    b = reproduce_row(seed=args.seed)
    print(f"\nBDIA row (Fig. 2: K = {b['blocks']}, l = {b['level']}, fp32): max reconstruction error\n"
          f"  without quantisation (eq. 16)     paper: grows ×2 per block   ours {b['plain']:.3e}\n"
          f"  with quantisation + side bits     paper: 0                    ours {b['quantised']:.3e}")
    fewbit = reproduce_fewbit()
    print("\nFewBit's builtin derivative quantisations on their own objective (Novikov et al.) vs ours")
    print(format_fewbit_rows(fewbit))
    memory = measure_all()
    print("\nApprox-BP App. B (Figs. 5, 6): one block's saved activations, in 16-bit [b, n, c] tensors")
    print(format_rows(memory))
    return ([bdia_verdict(b)]
            + [(f"FewBit {r.activation} k={r.bits}", r.ok) for r in fewbit]
            + [(f"App. B {r.block} {r.variant}", r.ok) for r in memory])


def _export(args, argv) -> int:
    from approxbp.kernels.codegen import export  # the top layer (approxbp/) may use both sides

    written = export(args.tables or None, args.out_dir)
    for folder in sorted({str(p.parent) for p in written}):
        print(f"wrote {sum(str(p.parent) == folder for p in written)} kernel modules under {folder}")
    return 0


def _figures(args, argv) -> int:
    from approxbp.approximations import tables as T
    from approxbp.approximations.files import save_figure
    from approxbp.fitting.atlas import write_atlas
    from approxbp.fitting.plots import plot_invact, plot_relu_sum

    args.out = _figures_dir(args.out)
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
    committed = Path(__file__).resolve().parent.parent / "docs" / "figures" / "bdia_toy_gpt.json"
    results = next((p for p in (args.out / "bdia_toy_gpt.json", committed) if p.is_file()), None)
    if results is None:
        print("no bdia_toy_gpt.json to re-plot: retraining the toy GPT (about 2–3 minutes on 2 cores)",
              file=sys.stderr)
    written += bdia.write_toy_gpt(args.out, results_json=results, progress=False)
    for p in written:
        print(f"wrote {p}")
    return 0


def _atlas(args, argv) -> int:
    import json

    from approxbp.approximations.activations import named_activation
    from approxbp.fitting.atlas import write_atlas

    acts, names = args.activation or ["gelu", "silu"], args.name or []
    if len(names) > len(acts):
        raise ValueError(f"{len(names)} --name for {len(acts)} --activation: give one label per expression")
    named = [named_activation(a, names[i] if i < len(names) else None) for i, a in enumerate(acts)]
    written = write_atlas(_figures_dir(args.out), tuple(named), progress=_progress(args))
    rows = json.loads(written[0].read_text())["rows"]
    for act, entries in rows.items():
        print(f"{act}: L2 (N(0,1)-weighted) of the backward multiplier, per saved bit")
        for e in entries:
            family, bits = e.get("family"), e.get("bits")  # atlas result rows, not tables
            if family in ("fewbit-normal", "relu-sum-derivative") and bits <= 4 or family.startswith("invact"):
                print(f"  {e['label']:<40} {bits} bit  L2 {e['l2_normal']:.3e}  L∞ {e['linf']:.3e}")
    for p in written:
        print(f"wrote {p}")
    return 0


def _bdia(args, argv) -> int:
    progress = _progress(args)
    import json

    import torch

    from approxbp import bdia_experiments as bdia

    out = _figures_dir(args.out)
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


def _tables(args, argv) -> int:
    from approxbp.approximations import tables as T

    paths = args.files or T.table_paths(args.family)
    bad = 0
    for p in paths:
        try:
            t = T.load(p)
        except (ValueError, OSError) as err:
            print(f"INVALID {err}")
            bad += 1
            continue
        if args.family and t.family != args.family:
            continue
        if t.family == "relu-sum":
            extra = f"k={t.bits} {t.objective:<10} loss={t.loss:.6e}"
        else:
            m = t.metrics
            extra = f"{t.form:<10} " + " ".join(f"L∞ {b} {m[f'linf_{b}']:.2e}" for b in t.branches)
        name = T.packaged_name(p)
        shown = f"{name}.json" if name else p
        print(f"{shown!s:<48} {t.source:<5} {extra}")
    print(f"{len(paths)} tables, " + (f"{bad} invalid" if bad else "all valid"))
    return 2 if bad else 0


def _certify_tables(paths, progress: bool, write: bool, only_default: bool = False, **options) -> dict[str, bool]:
    """Certify each table (read once), print its lines, store the certificate when ``write``; ``only_default``
    skips the tables ``approxbp certify`` leaves out by default. Returns name → whether its claims hold."""
    from approxbp.approximations import tables as T
    from approxbp.fitting.certify import certifiable, certify_table

    tell = (lambda msg: print(f"[certify] {msg}", file=sys.stderr, flush=True)) if progress else None
    held = {}
    for path in paths:
        t = T.load(path)
        if only_default and not certifiable(t):
            continue
        entry, lines, held[t.name] = certify_table(t, progress=tell, **options)
        print("\n".join(lines), flush=True)
        if write and entry is not None:
            T.save(t.with_metrics(certified=entry), path)
    return held


def _certify_regenerated(paths, progress: bool) -> bool:
    """``reproduce --full``: certify the regenerated tables ``approxbp certify`` covers and store the
    certificates in them; False if a claim fails."""
    print("\ncertificates (approxbp certify: rigorous bounds by interval arithmetic)")
    return all(_certify_tables(paths, progress, write=True, only_default=True).values())


def _certify(args, argv) -> int:
    """``approxbp certify``: one line per certificate; exit 1 when a claim fails."""
    from approxbp.approximations import tables as T

    progress = _progress(args)
    if not (args.budget > 0 and 0 < args.rtol < 10 and (args.max_boxes is None or args.max_boxes > 0)):
        raise ValueError("--budget and --max-boxes must be > 0 and --rtol in (0, 10)")
    t0 = time.perf_counter()
    paths = args.tables or T.table_paths()
    held = _certify_tables(paths, progress, write=args.write and not args.kernel_constants,
                           only_default=not args.tables, budget_s=args.budget, rtol=args.rtol,
                           rounded=args.kernel_constants, max_boxes=args.max_boxes)
    failed = [name for name, ok in held.items() if not ok]
    print(f"{len(held)} tables in {time.perf_counter() - t0:.1f} s: "
          + ("every certificate holds (each table's lines say what it certifies)" if not failed
             else f"FAILED: {', '.join(failed)}"))
    if args.write:
        print("tables updated; regenerate their kernels with `approxbp export`")
    return 1 if failed else 0


def parse_bits(text: str) -> list[int]:
    """'1-4' → [1, 2, 3, 4]; '2,3,5' → [2, 3, 5]; '1-3,8' → [1, 2, 3, 8] (each 1…8, once, in order)."""
    from approxbp.approximations.relu_sum import check_bits

    out: list[int] = []
    for part in filter(None, text.replace(" ", "").split(",")):
        lo, sep, hi = part.partition("-")
        try:
            ks = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"--bits {text!r}: expected a range like 1-4 and/or a list like 2,3,5") from None
        out += [check_bits(k) for k in ks if k not in out]
    if not out:
        raise ValueError(f"--bits {text!r}: no bit-width")
    return out


def _sweep(args, argv) -> int:
    """``approxbp sweep``: every (activation, k, objective) fitted, one summary line each; tables to --out-dir."""
    from approxbp.approximations import tables as T
    from approxbp.approximations.activations import named_activation
    from approxbp.approximations.files import check_writable, safe_stem
    from approxbp.fitting.relu_sum import cli_command, fit_relu_sum

    progress, acts = _progress(args), []
    for spec in args.activation:  # every name and expression parsed, and admitted by eq. 13's tails, before any fit
        name, sep, expr = spec.partition("=")
        act = named_activation(expr, name) if sep and name.isidentifier() else named_activation(spec)
        act.check_relu_sum_asymptotics()
        acts.append(act)
    bits = parse_bits(args.bits)
    objectives = ("primitive", "derivative") if args.objective == "both" else (args.objective,)
    jobs = [(a, o, k, args.out_dir / f"{safe_stem(T.relu_sum_name(a.name, k, o))}.json" if args.out_dir else None)
            for a in acts for o in objectives for k in bits]
    for *_, path in jobs:  # fail now, not after the sweep
        if path is not None:
            check_writable(path, overwrite=args.force)
    t0 = time.perf_counter()
    print(f"{'activation':<14} {'k':>2} {'objective':<10} {'loss':>14} {'at best':>8}  {'found by':<18} {'s':>6}")
    done, failed = {}, []  # (activation, objective, k) → knots: the k + 1 fit starts from them
    for a, objective, k, path in jobs:
        t1 = time.perf_counter()
        try:
            fit = fit_relu_sum(a, k, objective, restarts=args.restarts, seed=args.seed, workers=args.workers,
                               progress=progress, command=cli_command(argv),
                               lower_knots=done.get((a.name, objective, k - 1)))
        except (ValueError, RuntimeError, ArithmeticError, MemoryError) as err:  # the rest of the sweep goes on
            failed.append(f"{a.name} k={k} {objective}: {' '.join(str(err).split())[:200]}")
            print(f"{a.name[:14]:<14} {k:>2} {objective:<10} FAILED ({type(err).__name__})", flush=True)
            continue
        done[(a.name, objective, k)] = fit.x
        t = fit.table
        print(f"{a.name[:14]:<14} {k:>2} {objective:<10} {t.loss:>14.6e} {fit.at_best:>3} of "
              f"{len(fit.restarts):<2}  {t.provenance['found_by'][:18]:<18} {time.perf_counter() - t1:>6.1f}",
              flush=True)
        if path is not None:
            T.save(t, path, overwrite=args.force)
    print(f"{len(jobs) - len(failed)} of {len(jobs)} fits in {time.perf_counter() - t0:.1f} s"
          + (f"; tables in {args.out_dir}" if args.out_dir else ""))
    for line in failed:
        print(f"  failed: {line}")
    return 1 if failed else 0


def _fit_free_levels(args, argv) -> int:
    """``approxbp fit relu-sum --levels free``: FewBit's family, with FewBit's own table where it has one."""
    import json

    from approxbp.approximations.activations import named_activation
    from approxbp.approximations.files import write_atomic
    from approxbp.fitting.free_levels import FEWBIT_INTERVAL, fewbit_reference, fit_free_levels
    from approxbp.fitting.relu_sum import cli_command

    if (args.objective or "derivative") != "derivative":
        raise ValueError("--levels free fits the derivative (FewBit's objective); drop --objective primitive")
    act = named_activation(args.activation, args.name)
    interval = tuple(args.interval) if args.interval else FEWBIT_INTERVAL
    fit = fit_free_levels(act, args.bits, interval, restarts=args.restarts, seed=args.seed)
    print(f"{fit.activation} k={fit.bits} free levels on [{interval[0]:g}, {interval[1]:g}] (FewBit's family): "
          f"∫(h' − q)² = {fit.loss:.10e}")
    print(f"  borders  {np.array2string(fit.borders, precision=6, max_line_width=110)}")
    print(f"  levels   {np.array2string(fit.levels, precision=6, max_line_width=110)}")
    print("  starts   " + ", ".join(f"{k} {v:.8e}" for k, v in fit.starts.items()))
    theirs = fewbit_reference().get((fit.activation, fit.bits))
    if theirs is not None and theirs.interval == interval:
        value = theirs.loss()
        gap = (value - fit.loss) / fit.loss
        print(f"  FewBit   builtin table {value:.10e} (measured here: "
              + (f"{100 * gap:.1f} % above ours, a local optimum)" if gap > 1e-9 else "ours equals it)"))
    if args.out:
        from approxbp.approximations.tables import FREE_LEVELS_SCHEMA

        record = {"schema": FREE_LEVELS_SCHEMA, "note": "FewBit's family, not an approxbp.table (no Σw = 1, "
                  "Σw·c = 0)", "activation": fit.activation, "bits": fit.bits, "interval": list(interval),
                  "borders": fit.borders.tolist(), "levels": fit.levels.tolist(), "loss": fit.loss,
                  "starts": fit.starts, "command": cli_command(argv)}
        print(f"  wrote    {write_atomic(args.out, json.dumps(record, indent=1) + chr(10))} (a study result: "
              "export, cost, certify and the drop-ins take eq. 13's or InvAct's tables)")
    return 0


def _setup(args):
    """--mode's preset with every set-up option given on the command line in place of its own."""
    from dataclasses import replace

    from approxbp.setup import PRESETS

    names = ("weights", "autocast", "train", "optimizer", "shard", "adapters", "norms", "task")
    changes = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.lora_targets:
        changes["lora_targets"] = args.lora_targets if args.lora_targets == "all-linear" else tuple(
            t.strip() for t in args.lora_targets.split(",") if t.strip())
    if args.compile:
        changes["compile"] = True
    return replace(PRESETS[args.mode], **changes)


def _plan(args, argv) -> int:
    """``approxbp plan``: the step's memory before and after, the choice per layer, the options measured."""
    from approxbp import plan as P
    from approxbp.approximations.files import write_atomic

    for name in ("batch", "seq", "lora_r"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    tell = (lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True)) if _progress(args) else None
    t0 = time.perf_counter()
    budget = P.parse_size(args.budget) if args.budget else None
    args.mode = _setup(args)
    if args.maximize:
        if budget is None:
            raise ValueError("--maximize needs --budget")
        best, result = P.maximize(args.model, args.maximize, args.batch, args.seq, args.mode, budget, args.lora_r,
                                  progress=tell, checkpoint=args.checkpoint, traced=args.trace or None, use=args.use,
                                  grain=args.grain)
        print(f"largest {args.maximize} that fits {P.size(budget)}: {best}")
    elif args.use:
        result = P.evaluate(args.model, args.batch, args.seq, args.mode, args.use, args.lora_r, progress=tell,
                            checkpoint=args.checkpoint, traced=args.trace or None, budget=budget)
    else:
        result = P.plan(args.model, args.batch, args.seq, args.mode, budget, args.lora_r, progress=tell,
                        checkpoint=args.checkpoint, traced=args.trace or None)
    print(P.report(result))
    print(f"planned in {time.perf_counter() - t0:.1f} s on fake tensors")
    if args.out:
        write_atomic(args.out, result.to_json() + "\n")
        print(f"wrote {args.out}")
    if args.figure:
        print(f"wrote {P.figure(result, args.figure)}")
    return 0


def _cost(args, argv) -> int:
    """``approxbp cost``: one row per kernel, then the kernels over 0.9 of the budget."""
    import json
    import re

    from approxbp import cost
    from approxbp.approximations.files import write_atomic

    m = re.fullmatch(r"sm_(\d+)", args.arch)
    if not m:
        raise ValueError(f"--arch {args.arch!r}: expected sm_NN, e.g. sm_90")
    tell = (lambda i, n, name: print(f"[{i}/{n}] {name}", file=sys.stderr)) if _progress(args) else None
    t0 = time.perf_counter()
    results = cost.run(args.tables or None, args.dtype, int(m[1]), extras=not args.tables, progress=tell)
    print(f"{args.arch}, {args.dtype}; budget {cost.BUDGET:.2f} SASS instructions per byte moved (H100); ratio = "
          "instructions per element / (budget × bytes per element)")
    print(cost.HEADER)
    for r in results:
        print(r.row())
    over = [r.name for r in results if r.ratio > 0.9]
    print(f"{len(results)} kernels in {time.perf_counter() - t0:.1f} s; {len(over)} above 0.9 of the budget"
          + (f": {', '.join(over[:8])}{' …' if len(over) > 8 else ''}" if over else ""))
    if args.json:
        write_atomic(args.json, json.dumps(cost.as_json(results, int(m[1])), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


#: name → (its parser, its run): one function each, in the order of ``approxbp --help``
COMMANDS = {
    "fit": (_parser_fit, _fit), "sweep": (_parser_sweep, _sweep), "reproduce": (_parser_reproduce, _reproduce),
    "export": (_parser_export, _export), "figures": (_parser_figures, _figures), "atlas": (_parser_atlas, _atlas),
    "bdia": (_parser_bdia, _bdia), "cost": (_parser_cost, _cost), "plan": (_parser_plan, _plan),
    "certify": (_parser_certify, _certify), "tables": (_parser_tables, _tables),
}

if __name__ == "__main__":
    raise SystemExit(main())
