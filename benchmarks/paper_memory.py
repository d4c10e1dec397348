"""The papers' memory tables against the planner (approxbp.papers.paper_memory): every row run, the results written to
benchmarks/results/paper_memory.json and the section of docs/memory.md between its markers rewritten from them.

    python benchmarks/paper_memory.py [--docs docs/memory.md] [--from-results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from approxbp.approximations.files import write_atomic

from approxbp.papers import paper_memory as M

RESULTS = Path(__file__).parent / "results" / "paper_memory.json"
BEGIN, END = "<!-- paper-memory: begin (python benchmarks/paper_memory.py) -->", "<!-- paper-memory: end -->"


def to_json(rows: list[M.Row], seconds: float) -> dict:
    return {"seconds": round(seconds, 1), "rows": [
        {"table": r.group.table, "setup": r.group.setup, "use": r.use, "paper": r.paper, "ours": r.ours,
         "seconds": round(r.seconds, 1)} for r in rows]}


def from_json(data: dict) -> list[M.Row]:
    """Rows rebuilt from the JSON against the current groups (a row whose group changed is dropped)."""
    groups = {(g.table, g.setup): g for g in M.GROUPS}
    return M.with_changes([M.Row(groups[d["table"], d["setup"]], d["use"], d["paper"], d["ours"], None, None,
                                 d["seconds"]) for d in data["rows"] if (d["table"], d["setup"]) in groups])


def write_docs(path: Path, rows: list[M.Row], seconds: float) -> None:
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} … {END} section to rewrite")
    within = sum(r.within for r in rows)
    explained = sum(not r.within and bool(r.explanation) for r in rows)
    head = (f"{len(rows)} rows, run in {seconds:.0f} s on this machine's CPU: {within} within the targets, "
            f"{explained} outside them for a measured cause, {len(rows) - within - explained} unexplained.")
    section = f"{BEGIN}\n{head}\n\n{M.markdown(rows)}\n{END}"
    write_atomic(path, text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=Path, default=None, help="rewrite this page's paper-memory section")
    ap.add_argument("--from-results", action="store_true", help="no run: rewrite the docs from the JSON")
    args = ap.parse_args(argv)
    if args.from_results:
        data = json.loads(RESULTS.read_text())
        rows, seconds = from_json(data), data["seconds"]
    else:
        t0 = time.perf_counter()
        rows = M.reproduce(progress=lambda msg: print(msg, file=sys.stderr, flush=True))
        seconds = time.perf_counter() - t0
        write_atomic(RESULTS, json.dumps(to_json(rows, seconds), indent=1) + "\n")
    print(M.text(rows))
    if args.docs:
        write_docs(args.docs, rows, seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
