"""Wall time and objective of ReLU-sum fits for gelu/silu at k = 1..8 (CPU; not a kernel speed).

    python benchmarks/fit_relu_sum.py [--out benchmarks/results/relu_sum_fit_cpu.json] [--restarts 4]

Targets (issue 2): k = 2 reproduced in < 5 s, k = 8 (255 knots) converged in < 5 min.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "relu_sum_fit_cpu.json")
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    rows = []
    for act in ("gelu", "silu"):
        for objective in ("primitive", "derivative"):
            for k in range(1, 9):
                t0 = time.perf_counter()
                t = fit_relu_sum(act, k, objective, restarts=args.restarts, seed=0, workers=args.workers,
                                 progress=False).table
                wall = time.perf_counter() - t0
                rows.append({"activation": act, "objective": objective, "bits": k, "method": t.provenance["method"],
                             "restarts": args.restarts, "wall_seconds": round(wall, 3), "loss": t.loss,
                             "grad_inf_norm": t.metrics["grad_inf_norm"],
                             "hessian_min_eig": t.metrics.get("hessian_min_eig")})
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
