"""Is a plan's peak a bound? Each row plans a tiny model on fake tensors under a budget (``approxbp plan``'s search:
approximations, MS-norms, then recompute / offload / the chunked loss where they are needed), applies the plan to the
real model the way a user does (``Plan.apply`` with the example batch), runs one real training step (forward,
backward, AdamW) under PyTorch's ``MemTracker`` (each drop-in allocating what its kernel allocates, offloaded
tensors leaving the device as on a GPU) and compares its peak with the plan's.

    python benchmarks/plan_peaks.py [--only NAME,…] [--out benchmarks/results/plan_peaks.json] [--docs docs/memory.md]

Pass: planned ≥ measured and planned ≤ 1.10 × measured, every row. Budgets are set per row as a fraction of the
way from the exact step's peak down to the approximations' (``approx``: between them, no moves needed) or below the
approximations' (``moves``: recompute, offload or the chunked loss needed).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from approxbp.approximations.files import write_atomic

from approxbp.planner import models as MD
from approxbp.planner import plan as P
from approxbp.planner import step_memory as SM
from approxbp.planner import training as SU
from approxbp.planner.plan_step import step_inputs
from approxbp.planner.request import Request
from approxbp.planner.step_memory import size

LLAMA = "llama:hidden=64,layers=4,heads=4,intermediate=128,vocab=1000"
#: name → (model, set-up, batch, seq, where the budget lies: "approx" or "moves", that fraction of the way).
ROWS = {
    "llama bf16 full, approximations": (LLAMA, "bf16", 4, 64, ("approx", 0.5)),
    "llama bf16 full, moves": (LLAMA, "bf16", 4, 64, ("moves", 0.05)),
    "llama autocast, moves": (LLAMA, "autocast", 4, 64, ("moves", 0.05)),
    "llama LoRA, approximations": (LLAMA, "lora", 4, 64, ("approx", 0.5)),
    "llama LoRA, moves": (LLAMA, "lora", 4, 64, ("moves", 0.1)),
    "llama bf16, vocab 16k, chunked loss": (LLAMA.replace("vocab=1000", "vocab=16000"), "bf16", 4, 512,
                                            ("moves", 0.1)),
    "vit bf16 full, moves": ("vit:hidden=64,layers=4,heads=4,intermediate=128,image=32,patch=4", "bf16", 8, 0,
                             ("moves", 0.05)),
    "bert bf16 full, moves": ("bert:hidden=64,layers=4,heads=4,intermediate=128,vocab=1000", "bf16", 4, 64,
                              ("moves", 0.05)),
}


def budget_for(model: str, setup: str, batch: int, seq: int, where: tuple[str, float]) -> int:
    """The row's budget: ``approx``: that fraction of the way from the exact peak to the most-saving assignment's;
    ``moves``: the most-saving assignment's peak less that fraction of its activations."""
    request = Request(model=model, batch=batch, seq=seq or 1, setup=setup)
    most = P.plan(request)  # no budget: the most-saving assignment of the approximations
    high, low = most.before.peak, most.after.peak
    kind, f = where
    return round(high - f * (high - low)) if kind == "approx" else round(low - f * most.after.activations)


def measured_peak(plan: P.Plan, model: str, setup: str, batch: int, seq: int) -> tuple[int, str, list[str]]:
    """(peak, its moment, what the application skipped) of one real step of ``model`` with ``plan`` applied."""
    setup = SU.as_setup(setup)
    with SU.weights_for(setup):
        torch.manual_seed(0)
        net, make_inputs = MD.model_spec(model)()
        net = SM.prepare(net, setup)
    inputs = step_inputs(make_inputs, batch, seq or 1, setup)
    report = plan.apply(net, example_input=inputs, check=False)
    step = SM.traced_step(net, inputs, setup)
    return step.peak, step.moment, report.skipped


def row(name: str) -> dict:
    model, setup, batch, seq, where = ROWS[name]
    start = time.perf_counter()
    budget = budget_for(model, setup, batch, seq, where)
    try:
        plan = P.plan(Request(model=model, batch=batch, seq=seq or 1, setup=setup), budget=budget)
    except ValueError as err:  # refused: no plan whose traced step fits (never a promise it would break)
        return {"name": name, "model": model, "setup": setup, "budget": budget, "refused": str(err), "ok": True,
                "least_traced": getattr(err, "least_traced", None),
                "seconds": time.perf_counter() - start}
    peak, moment, skipped = measured_peak(plan, model, setup, batch, seq)
    planned = plan.after.peak
    moves = plan.moves.moves if plan.moves else {}
    kinds = sorted({v.split(" ")[0] for v in moves.values()} | ({"chunked-loss"} if plan.chunked_loss else set()))
    return {"name": name, "model": model, "setup": setup, "batch": batch, "seq": seq or None, "budget": budget,
            "planned": planned, "modelled": plan.moves.peak if plan.moves else None, "measured": peak,
            "measured_moment": moment, "ratio": planned / peak, "ok": peak <= planned <= 1.10 * peak,
            "moves": {m: 1 if m == "chunked-loss" else sum(v == m or v.startswith(m) for v in moves.values())
                      for m in kinds},
            "options": sorted({v.option for v in plan.layers.values()}), "ms_norm": plan.ms_norm.chosen,
            "skipped": [s for s in skipped if "exact by choice" not in s and not s.startswith("saved bytes:")],
            "seconds": time.perf_counter() - start}


def _why(row: dict) -> str:
    """A refusal in a few words: the least peak of the plans traced (``NoFit.least_traced``), or the model's."""
    if row.get("least_traced") is not None:
        return f"every plan traced peaks at {size(row['least_traced'])} or more"
    return "no plan reaches it in the moves' model"


def markdown(rows: list[dict]) -> str:
    head = ("| set-up | budget | planned peak | measured peak | planned / measured | moves | options |\n"
            "|---|---:|---:|---:|---:|---|---|\n")
    return head + "".join(
        f"| {r['name']} | {size(r['budget'])} | refused: {_why(r)} | | | | |\n" if "refused" in r else
        f"| {r['name']} | {size(r['budget'])} | {size(r['planned'])} | {size(r['measured'])} | {r['ratio']:.3f}"
        f"{'' if r['ok'] else ' ✗'} | {', '.join(f'{k} {v}' for k, v in r['moves'].items()) or '—'} | "
        f"{', '.join(r['options'])}{' + MS-norms' if r['ms_norm'] else ''} |\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--only", help="comma-separated row names (substrings)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_peaks.json")
    ap.add_argument("--docs", type=Path, help="rewrite the table between the plan-peaks markers of this page")
    args = ap.parse_args()
    names = [n for n in ROWS if not args.only or any(s.strip() in n for s in args.only.split(","))]
    rows = []
    for name in names:
        r = row(name)
        rows.append(r)
        if "refused" in r:
            print(f"{name:<40} budget {size(r['budget']):>11}  refused: {r['refused'][:160]}", flush=True)
            continue
        print(f"{name:<40} budget {size(r['budget']):>11}  planned {size(r['planned']):>11}  measured "
              f"{size(r['measured']):>11}  ratio {r['ratio']:.3f} {'ok' if r['ok'] else 'FAIL'}  "
              f"({r['seconds']:.0f} s)", flush=True)
    write_atomic(args.out, json.dumps({"machine": platform.processor() or platform.machine(),
                                       "torch": torch.__version__, "rows": rows}, indent=1))
    if args.docs:
        text = args.docs.read_text()
        a, b = "<!-- plan-peaks -->\n", "<!-- /plan-peaks -->"
        if a not in text or b not in text:
            raise SystemExit(f"{args.docs}: no {a.strip()} … {b} markers")
        args.docs.write_text(text[:text.index(a) + len(a)] + markdown(rows) + text[text.index(b):])
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
