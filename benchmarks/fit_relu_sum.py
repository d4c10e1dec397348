"""Wall time and objective of ReLU-sum fits for gelu/silu at k = 1..8, and at k = 3 for two activations with
algebraic tails (the interval search doubles [−64, 64] until no knot lies on an end), on the CPU; not a kernel speed.

    python benchmarks/fit_relu_sum.py [--out benchmarks/results/relu_sum_fit_cpu.json] [--restarts 4] [--slow-tails]

Each row records the commit it was measured at; ``--slow-tails`` measures only the algebraic-tail rows and keeps the
others as they were measured.

Targets: k = 2 reproduced in < 5 s, k = 8 (255 knots) converged in < 5 min; the algebraic tails at k = 3 in
≤ 60 s on 2 cores (a researcher's day: `approxbp fit relu-sum --bits 3` answers within a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from approxbp.approximations.files import write_atomic
from approxbp.fitting import fit_relu_sum

#: Activations whose residual falls like 1/|x|: a wide interval, graded quadrature panels (fitting/objective.py).
SLOW_TAILS = ("x*(1+x/sqrt(1+x**2))/2", "(x + sqrt(x**2 + 4))/2")


def _commit() -> str:
    """The checked-out commit (with '+changes' when the working tree differs from it)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "relu_sum_fit_cpu.json")
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--slow-tails", action="store_true", help="only the algebraic-tail rows; keep the others")
    args = ap.parse_args()
    rows, commit = [], _commit()
    runs = [(act, objective, k) for act in ("gelu", "silu") for objective in ("primitive", "derivative")
            for k in range(1, 9)] if not args.slow_tails else []
    runs += [(act, objective, 3) for act in SLOW_TAILS for objective in ("primitive", "derivative")]
    if args.slow_tails and args.out.is_file():
        rows = [r for r in json.loads(args.out.read_text())["rows"] if r["activation"] not in SLOW_TAILS]
    for act, objective, k in runs:
        t0 = time.perf_counter()
        t = fit_relu_sum(act, k, objective, restarts=args.restarts, seed=0, workers=args.workers,
                         progress=False).table
        wall = time.perf_counter() - t0
        rows.append({"activation": act, "objective": objective, "bits": k, "method": t.provenance["method"],
                     "interval": list(t.interval),
                     "restarts": args.restarts, "wall_seconds": round(wall, 3), "loss": t.loss,
                     "grad_inf_norm": t.metrics["grad_inf_norm"],
                     "hessian_min_eig": t.metrics.get("hessian_min_eig"), "commit": commit})
        print(f"{act:<5} {objective:<10} k={k}  {wall:7.2f} s  loss {t.loss:.6e}", flush=True)
    result = {"benchmark": "relu-sum fit wall time", "device": "cpu",
              "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "python": platform.python_version(),
              "command": "python benchmarks/fit_relu_sum.py", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
