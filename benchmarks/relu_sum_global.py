"""Every committed ReLU-sum table against the grid DP's polished optimum (an independent global start).

    python benchmarks/relu_sum_global.py [--out benchmarks/results/relu_sum_global.json]

For each registry activation, k = 2…8 and both objectives: the grid DP (fitting/grid_dp.py: exact on its grid for
the derivative objective, a separable relaxation for the primitive) polished, against the committed table's loss.
Exits 1 when a committed table is above it by more than a relative 1e-9.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from approxbp.approximations import REGISTRY, get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.files import write_atomic
from approxbp.fitting.grid_dp import grid_dp_knots
from approxbp.fitting.objective import ReluSumObjective, interval_for
from approxbp.fitting.relu_sum import polish


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "relu_sum_global.json")
    args = ap.parse_args()
    rows, worse = [], []
    for name in REGISTRY:
        act = get_activation(name)
        for objective in ("derivative", "primitive"):
            A, B, *_ = interval_for(act, objective)
            for k in range(2, 9):
                t0 = time.perf_counter()
                obj = ReluSumObjective(act, k, objective, (A, B))
                dp = obj(polish(obj, grid_dp_knots(obj)))[0]
                table = table_files.load(f"relu_sum/{table_files.relu_sum_name(name, k, objective)}")
                gap = (table.loss - dp) / dp
                rows.append({"activation": name, "objective": objective, "bits": k, "table": table.loss,
                             "grid_dp": dp, "table_above_dp": gap, "seconds": round(time.perf_counter() - t0, 2)})
                print(f"{name:<10} {objective:<10} k={k}  table {table.loss:.9e}  grid DP {dp:.9e}  "
                      f"table above by {gap:+.2e}", flush=True)
                if gap > 1e-9:
                    worse.append(f"{name} k={k} {objective}")
    write_atomic(args.out, json.dumps({"rows": rows, "worse": worse}, indent=1) + "\n")
    print(f"{len(rows)} tables; " + (f"ABOVE the grid DP: {', '.join(worse)}" if worse else
                                     "every committed table is at or below the grid DP's polished optimum"))
    return 1 if worse else 0


if __name__ == "__main__":
    raise SystemExit(main())
