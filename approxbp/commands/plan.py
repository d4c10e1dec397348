"""``approxbp plan``: a training step's memory on fake tensors and a replacement per layer. The arguments are the
planner's (:func:`approxbp.planner.request.add_arguments`, a :class:`~approxbp.planner.request.Request` and what to
do with it); this module adds --out, --figure and the progress lines."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from approxbp.commands import common

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    from approxbp.planner.request import add_arguments

    pln = add(sub, "plan", help="a training step's memory measured on fake tensors (no hardware, no weights) and a "
              "replacement per layer: exact, ReLU-sum k = 1…4, InvAct, MS-norms, chosen under --budget")
    add_arguments(pln)
    pln.add_argument("--out", type=Path, default=None,
                     help="write the plan as JSON here (apply it: "
                     "approxbp.planner.result.Plan.load(path).apply(model))")
    pln.add_argument("--figure", type=Path, default=None, help="write the memory figure (PNG) here")
    common.no_progress(pln)


def run(args, argv) -> int:
    """``approxbp plan``: the step's memory before and after, the choice per layer, the options measured."""
    from approxbp.approximations.files import write_atomic
    from approxbp.planner import plan as P
    from approxbp.planner import report as PR
    from approxbp.planner import step_memory as SM
    from approxbp.planner.request import Request, compile_budgets

    tell = (lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True)) if common.progress_on(args) else None
    t0 = time.perf_counter()
    budget = SM.parse_size(args.budget) if args.budget else None
    request = Request.from_args(args)
    args.compile_budgets = compile_budgets(args.compile_budgets)
    if args.compile_budgets and (args.maximize or args.use):
        raise ValueError("--compile-budgets weighs the planner's own assignments: not with --maximize or --use")
    if args.pareto is not None:
        return _pareto(request, args, tell, t0)
    if args.maximize:
        if budget is None:
            raise ValueError("--maximize needs --budget")
        best, result = P.maximize(request, what=args.maximize, budget=budget, use=args.use, grain=args.grain,
                                  progress=tell)
        print(f"largest {args.maximize} that fits {SM.size(budget)}: {best}")
    elif args.use:
        result = P.evaluate(request, use=args.use, budget=budget, progress=tell)
    else:
        if budget is None and request.traced is None and not args.modelled and SM.traceable(request.setup) \
                and not request.setup.compile:  # the step's peak is the first number (--modelled: the fast model)
            request = replace(request, traced=True)
        result = P.plan(request, budget=budget, gpu=args.gpu, compile_budgets=args.compile_budgets, progress=tell)
    print(PR.report(result))
    print(f"planned in {time.perf_counter() - t0:.1f} s on fake tensors")
    if args.out:
        write_atomic(args.out, result.to_json() + "\n")
        print(f"wrote {args.out}")
    if args.figure:
        print(f"wrote {PR.figure(result, args.figure)}")
    return 0


def _pareto(request, args, tell, t0: float) -> int:
    from approxbp.planner import pareto as C

    if args.gpu is None:
        raise ValueError("--pareto needs --gpu (the step times are modelled for a named GPU)")
    if args.budget or args.maximize or args.use or args.checkpoint or args.trace:
        raise ValueError("--pareto plans every budget itself: not with --budget, --maximize, --use, --checkpoint "
                         "or --trace")
    curve = C.pareto(request, gpu=args.gpu, points=args.pareto, compile_budgets=args.compile_budgets, progress=tell)
    print(C.table(curve, args.gpu))
    print(f"planned in {time.perf_counter() - t0:.1f} s on fake tensors")
    if args.out:
        meta = {"model": args.model, "batch": args.batch, "seq": args.seq, "gpu": args.gpu}
        print(f"wrote {C.write_json(curve, args.out, meta)}")
    if args.figure:
        print(f"wrote {C.figure(curve, args.figure, f'{args.model}, batch {args.batch}, seq {args.seq}')}")
    return 0
