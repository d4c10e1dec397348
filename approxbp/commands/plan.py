"""``approxbp plan``: a training step's memory on fake tensors and a replacement per layer; the set-up options
here are the planner's (:func:`setup_of` turns them into an :class:`approxbp.setup.Setup`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from approxbp.commands import common


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments of ``approxbp plan ARGV`` (what the papers' memory rows run, :mod:`approxbp.paper_memory`)."""
    parser = argparse.ArgumentParser(prog="approxbp")
    add_parser(parser.add_subparsers(dest="command", required=True), lambda parent, name, **kw: parent.add_parser(
        name, **kw))
    return parser.parse_args(["plan", *argv])


def add_parser(sub, add) -> None:
    from approxbp.commands.choices import MAXIMIZE, PRESETS
    from approxbp.gpus import GPUS

    pln = add(sub, "plan", help="a training step's memory measured on fake tensors (no hardware, no weights) and a "
              "replacement per layer: exact, ReLU-sum k = 1…4, InvAct, MS-norms, chosen under --budget")
    pln.add_argument("model", help="a Hugging Face config JSON file, the hub id of a config shipped with approxbp "
                     "(the papers' models: google/vit-base-patch16-224-in21k, huggyllama/llama-7b, …), or a model "
                     "type, each optionally with :key=value,… overrides "
                     "(llama:hidden=4096,layers=32,heads=32,intermediate=11008,vocab=32000); or "
                     "module:package.module:factory")
    pln.add_argument("--batch", type=int, default=1, help="batch size")
    pln.add_argument("--seq", type=int, default=512, help="sequence length (text models)")
    pln.add_argument("--mode", default="bf16", choices=tuple(PRESETS),
                     help="bf16 weights; fp32 weights under bf16 autocast; frozen bf16 weights with LoRA adapters; "
                     "bf16 under torch.compile (inductor's partitioner)")
    pln.add_argument("--checkpoint", action="store_true", help="activation checkpointing on top of --mode (each "
                     "block recomputed in backward; the whole step is traced by PyTorch's MemTracker)")
    pln.add_argument("--trace", action="store_true", help="trace a whole step (forward, backward, AdamW) with "
                     "MemTracker for the true peak and its moment, rather than the forward's saved tensors")
    pln.add_argument("--lora-r", type=int, default=8, help="LoRA rank (with --train lora or --mode lora)")
    _setup_arguments(pln)
    pln.add_argument("--budget", default=None, help="peak memory to fit, e.g. 24GiB (none: save the most)")
    pln.add_argument("--gpu", choices=list(GPUS), default=None, help="beyond the approximations, recompute and "
                     "offload blocks at the least modelled step time on this GPU (a roofline; approxbp/gpus.py)")
    pln.add_argument("--pareto", type=int, default=None, metavar="N",
                     help="with --gpu: the curve of modelled peak vs step time vs gradient-error bound over budgets, N "
                          "points on each stretch (approximations, then moves); --out writes it as JSON, --figure "
                          "plots it")
    pln.add_argument("--compile-budgets", nargs="?", const="1,0.6,0.4,0.2,0.1,0", default=None, metavar="B,…",
                     help="with --gpu and --budget or --pareto: also weigh each assignment under torch.compile at "
                          "these activation_memory_budget values (default 1,0.6,0.4,0.2,0.1,0), the fastest plan "
                          "wins (approxbp/compiled.py)")
    pln.add_argument("--maximize", choices=MAXIMIZE, default=None,
                     help="find the largest batch or sequence length that fits --budget (the plan is for it)")
    pln.add_argument("--grain", type=int, default=64, help="--maximize seq_len searches multiples of this many tokens")
    pln.add_argument("--use", default=None, help="evaluate this assignment instead of choosing one: exact, "
                     "relu-sum-k1…k4 or invact for every activation layer, each optionally +ms-norm (or ms-norm "
                     "alone), or a plan JSON (--out of an earlier plan); with --maximize, the largest size it fits")
    pln.add_argument("--out", type=Path, default=None,
                     help="write the plan as JSON here (apply it: approxbp.plan.Plan.load(path).apply(model))")
    pln.add_argument("--figure", type=Path, default=None, help="write the memory figure (PNG) here")
    common.no_progress(pln)


def _setup_arguments(pln) -> None:
    """The set-up options, each overriding --mode's preset."""
    from approxbp.commands.choices import ADAPTERS, AUTOCAST, NORMS, OPTIMIZERS, TRAIN, WEIGHTS
    from approxbp.tasks import TASKS

    setup = pln.add_argument_group("the set-up, option by option (each overrides --mode's preset)")
    setup.add_argument("--weights", choices=WEIGHTS, default=None,
                       help="stored weight dtype; nf4: the frozen base Linears in QLoRA's 4-bit NF4 with double-"
                            "quantised absmax, computing in bf16")
    setup.add_argument("--autocast", choices=AUTOCAST, default=None, help="the forward's autocast")
    setup.add_argument("--train", choices=TRAIN, default=None,
                       help="what trains: every parameter, LoRA adapters on a frozen base (peft's layout: fp32 "
                            "adapters on a 16-bit base), LoRA-FA (A frozen: only B trains), or nothing")
    setup.add_argument("--adapters", choices=ADAPTERS, default=None,
                       help="the LoRA adapters' dtype (auto: peft's "
                       "default, fp32 on a 16-bit base; QLoRA's script casts them to bf16)")
    setup.add_argument("--norms", choices=NORMS, default=None, help="the norms' weights: the weights' "
                       "dtype, or fp32 as QLoRA's script keeps them (a 16-bit input times them is fp32)")
    setup.add_argument("--task", choices=tuple(TASKS), default=None, help="the head and its loss (default: the "
                       "config's architectures, else causal-lm, or image-cls for a vision config)")
    setup.add_argument("--lora-targets", default=None, help="comma-separated Linear names, or all-linear (every "
                       "Linear but the output head); default: the attention query and value")
    setup.add_argument("--lora-dropout", type=float, default=None, help="peft's lora_dropout: each adapter saves "
                       "its own dropped copy of its input and a 1-byte mask (default 0: none)")
    setup.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                       help="its state: AdamW's two moments (the parameters' dtype), bitsandbytes' 8-bit moments, "
                       "its paged AdamW's fp32 moments (QLoRA's; counted as resident), or none (plain SGD)")
    setup.add_argument("--devices", type=int, default=None, help="GPUs the model is split over by blocks, as "
                       "Hugging Face's device_map=\"auto\" does: each GPU's peak and their sum (not with --budget)")
    setup.add_argument("--compile", action="store_true", help="torch.compile (inductor's partitioner)")
    setup.add_argument("--shard", type=int, default=None, help="ranks that shard parameters, gradients and "
                       "optimizer states (FSDP2 / ZeRO-3); activations are per rank")


def setup_of(args):
    """--mode's preset with every set-up option given on the command line in place of its own."""
    from dataclasses import replace

    from approxbp.setup import PRESETS

    names = ("weights", "autocast", "train", "optimizer", "shard", "adapters", "norms", "task", "lora_dropout",
             "devices")
    changes = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.lora_targets:
        changes["lora_targets"] = args.lora_targets if args.lora_targets == "all-linear" else tuple(
            t.strip() for t in args.lora_targets.split(",") if t.strip())
    if args.compile:
        changes["compile"] = True
    return replace(PRESETS[args.mode], **changes)


def run(args, argv) -> int:
    """``approxbp plan``: the step's memory before and after, the choice per layer, the options measured."""
    from approxbp import plan as P
    from approxbp import plan_result as PR
    from approxbp import step_memory as SM
    from approxbp.approximations.files import write_atomic

    for name in ("batch", "seq", "lora_r"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    tell = (lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True)) if common.progress_on(args) else None
    t0 = time.perf_counter()
    budget = SM.parse_size(args.budget) if args.budget else None
    args.mode = setup_of(args)
    args.compile_budgets = compile_budgets(args.compile_budgets)
    if args.compile_budgets and (args.maximize or args.use):
        raise ValueError("--compile-budgets weighs the planner's own assignments: not with --maximize or --use")
    if args.pareto is not None:
        return _pareto(args, tell, t0)
    if args.maximize:
        if budget is None:
            raise ValueError("--maximize needs --budget")
        best, result = P.maximize(args.model, args.maximize, args.batch, args.seq, args.mode, budget, args.lora_r,
                                  progress=tell, checkpoint=args.checkpoint, traced=args.trace or None, use=args.use,
                                  grain=args.grain)
        print(f"largest {args.maximize} that fits {SM.size(budget)}: {best}")
    elif args.use:
        result = P.evaluate(args.model, args.batch, args.seq, args.mode, args.use, args.lora_r, progress=tell,
                            checkpoint=args.checkpoint, traced=args.trace or None, budget=budget)
    else:
        result = P.plan(args.model, args.batch, args.seq, args.mode, budget, args.lora_r, progress=tell,
                        checkpoint=args.checkpoint, traced=args.trace or None, gpu=args.gpu,
                        compile_budgets=args.compile_budgets)
    print(PR.report(result))
    print(f"planned in {time.perf_counter() - t0:.1f} s on fake tensors")
    if args.out:
        write_atomic(args.out, result.to_json() + "\n")
        print(f"wrote {args.out}")
    if args.figure:
        print(f"wrote {PR.figure(result, args.figure)}")
    return 0


def compile_budgets(text: str | None) -> tuple[float, ...]:
    """``--compile-budgets 1,0.4,0``: the fractions, each in [0, 1] (refused in one line otherwise)."""
    if text is None:
        return ()
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"--compile-budgets {text}: expected comma-separated fractions in [0, 1], e.g. 1,0.4,0")
    return values


def _pareto(args, tell, t0: float) -> int:
    from approxbp import pareto as C

    if args.gpu is None:
        raise ValueError("--pareto needs --gpu (the step times are modelled for a named GPU)")
    if args.budget or args.maximize or args.use or args.checkpoint or args.trace:
        raise ValueError("--pareto plans every budget itself: not with --budget, --maximize, --use, --checkpoint "
                         "or --trace")
    curve = C.pareto(args.model, args.batch, args.seq, args.mode, args.gpu, args.lora_r, args.pareto, progress=tell,
                     compile_budgets=args.compile_budgets)
    print(C.table(curve, args.gpu))
    print(f"planned in {time.perf_counter() - t0:.1f} s on fake tensors")
    if args.out:
        meta = {"model": args.model, "batch": args.batch, "seq": args.seq, "gpu": args.gpu}
        print(f"wrote {C.write_json(curve, args.out, meta)}")
    if args.figure:
        print(f"wrote {C.figure(curve, args.figure, f'{args.model}, batch {args.batch}, seq {args.seq}')}")
    return 0
