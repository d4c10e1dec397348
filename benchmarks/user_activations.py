"""Four activations the project does not ship, each taken through the whole CLI path as a new user would (issue 35):
fit (ReLU-sum, both objectives, k = 2 and 3), InvAct, export, cost, certify, then patch and train from Python. Each
step is one command, timed, and ends ok or refused in one line with the reason.

    python benchmarks/user_activations.py [--only serf …] [--docs docs/user-activations.md]

writes ``benchmarks/results/user_activations.json`` (``--only`` replaces those activations' rows and keeps the
others) and, with ``--docs``, the table in that page. CPU only: `cost`
compiles for sm_90 offline and counts instructions; no kernel is timed here.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "user_activations.json"
#: name → (expression, extra `fit relu-sum` arguments): SERF, TanhExp, squareplus (algebraic tails: fitted on the
#: default ±64, the mass outside a constant), Logish and Smish (refused by eq. 13 and InvAct, each refusal naming the
#: free-level fit that the next rows run), and the piecewise ELU (exact InvAct), hard-swish (ReLU-sum) and
#: hard-sigmoid (exact InvAct with constant pieces);
#: the Gaussian-smoothed ReLU (no closed-form inverse: the fitted one-branch InvAct form, Newton steps).
ACTIVATIONS = {
    "serf": ("x*erf(log(1+exp(x)))", []),
    "tanhexp": ("x*tanh(exp(x))", []),
    "squareplus": ("(x + sqrt(x**2 + 4))/2", []),
    "logish": ("x*log(1 + sigmoid(x))", []),
    "smish": ("x*tanh(log(1+1/(1+exp(-x))))", []),
    "elu": ("elu", []),  # piecewise (issue 47): registered names, their expressions with Max and Min
    "hardswish": ("hardswish", []),
    "hardsigmoid": ("hardsigmoid", []),  # bounded, constant pieces: exact one-branch InvAct, q = 0 at 0 and 1
    "selu": ("selu", []),
    "celu": ("celu", []),
    "user_elu": ("Piecewise((x, x > 0), (exp(x) - 1, True))", []),  # a user's own Piecewise expression
    # E[ReLU(x + Z)], Z ~ N(0, 1): increasing, no closed-form inverse: the fitted one-branch InvAct form
    "smoothrelu": ("x*(1+erf(x/sqrt(2)))/2 + exp(-x**2/2)/sqrt(2*pi)", []),
}
#: Where eq. 13 refuses an activation (h − x does not tend to 0: Logish, Smish), the way forward its refusal names:
#: FewBit's free-level family on FewBit's [−100, 100].
FREE_LEVELS = ["--levels", "free"]
#: Boxes per certificate, a work budget (the answer does not depend on the machine): an InvAct branch (SERF's fast
#: form needs 38 000 and 87 000), a ReLU-sum table's k ≤ 2 global branch and bound (a gap of 1e-9 can take millions).
CERTIFY_BOXES = {"invact": 100_000, "relu-sum": 20_000}
TRAIN_STEPS = 20


def run(step: str, argv: list[str]) -> dict:
    """One CLI command: ok, or refused/failed with the last line it printed to stderr."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "approxbp", *argv], capture_output=True, text=True, cwd=ROOT)
    seconds = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    status = "ok" if done.returncode == 0 else ("refused" if lines and "approxbp: error:" in lines[-1] else "failed")
    out = {"step": step, "command": "approxbp " + " ".join(_quoted(a) for a in argv), "status": status,
           "seconds": seconds}
    if status != "ok":  # the CLI's one-line refusal, else the last line of its report (certify's verdict)
        last = lines[-1] if lines else (done.stdout.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        out["reason"] = last[:300]
        out["detail"] = _key_lines(done.stdout, verdicts=True)
    else:
        out["output"] = _key_lines(done.stdout)
    return out


def certify(family: str, tables: list[Path]) -> dict:
    """``approxbp certify`` on one family's tables with its box budget. A certificate the budget did not close is
    ``not certified`` (the bound is still rigorous, only not as tight as the claim), not a failure; a claim the
    certificate contradicts is ``failed``."""
    boxes = CERTIFY_BOXES[family]
    step = run(f"certify {family} ({boxes:,} boxes)", ["certify", *map(str, tables), "--max-boxes", str(boxes),
                                                       "--no-progress"])
    if step["status"] == "failed" and "VIOLATED" not in step.get("detail", "") and "OUTSIDE" not in step.get(
            "detail", ""):
        step["status"] = "not certified"
    return step


def _key_lines(stdout: str, verdicts: bool = False) -> str:
    """What a command found, in one line: a fit's loss and restarts, InvAct's L∞ per branch, cost's and certify's
    verdicts (not the paths of temporary files); ``verdicts``: certify's lines that are not ok."""
    marks = ("not certified (budget", "VIOLATED", "OUTSIDE") if verdicts else ("kernels in", "tables in", "∫(h' − q)²")
    keep = [" ".join(ln.split()) for ln in stdout.splitlines()
            if (not verdicts and ln.strip().startswith(("loss", "restarts", "left", "right", "invact ·")))
            or any(k in ln for k in marks)]
    return "; ".join(k.split("  q = ")[0] for k in keep)[:400]


def _quoted(a: str) -> str:
    return f"'{a}'" if any(c in a for c in " *()") else a


def train(expression: str, table: Path) -> dict:
    """A 2-layer MLP whose activation is a user module (class ``UserAct``) computing ``expression``, patched with
    ``table`` through a mapping, trained :data:`TRAIN_STEPS` SGD steps beside the stock copy from the same weights."""
    import torch
    from approxbp.approximations import get_activation
    from approxbp.kernels import patch_model
    from torch import nn

    f = get_activation(expression).torch_fn(0)

    class UserAct(nn.Module):
        def forward(self, x):
            return f(x)

    t0 = time.perf_counter()
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(16, 64), UserAct(), nn.Linear(64, 1))
    model = copy.deepcopy(stock)
    x, target = torch.randn(256, 16), torch.randn(256, 1)
    report = patch_model(model, family=None, tables={"UserAct": str(table)}, example_input=x)
    losses = []
    for m in (stock, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for _ in range(TRAIN_STEPS):
            opt.zero_grad()
            loss = (m(x) - target).square().mean()
            loss.backward()
            opt.step()
        losses.append(float(loss))
    before, after = report.saved_bytes
    return {"step": f"patch + train ({table.stem})", "status": "ok" if report.activations else "refused",
            "seconds": round(time.perf_counter() - t0, 1), "saved_bytes": [before, after],
            "loss_stock": losses[0], "loss_patched": losses[1],
            "loss_gap": abs(losses[1] - losses[0]) / abs(losses[0]),
            **({} if report.activations else {"reason": "; ".join(report.skipped)})}


class _Steps(list):
    """The steps of one activation, each printed to stderr as it ends (a long run shows where it is), with the
    temporary folder's path taken out of what they say."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = f"{folder}/"

    def append(self, step: dict) -> None:
        step = {k: v.replace(self.folder, "") if isinstance(v, str) else v for k, v in step.items()}
        super().append(step)
        print(f"  {step['step']:<32} {step['status']:<8} {step.get('seconds', '')} s  "
              f"{step.get('reason', step.get('output', ''))[:100]}", file=sys.stderr, flush=True)


def measure(name: str, expression: str, interval: list[str], folder: Path) -> list[dict]:
    steps, tables = _Steps(folder), []
    for bits in (2, 3):
        for objective in ("primitive", "derivative"):
            out = folder / f"{name}-k{bits}-{objective}.json"
            steps.append(run(f"fit relu-sum k={bits} {objective}",
                             ["fit", "relu-sum", "--activation", expression, "--name", name, "--bits", str(bits),
                              "--objective", objective, *interval, "--out", str(out), "--no-progress"]))
            tables += [out] if steps[-1]["status"] == "ok" else []
    if not tables:  # eq. 13 refused it: the free-level family takes any activation on a finite interval
        for bits in (2, 3):
            out = folder / f"{name}-k{bits}-free.json"
            steps.append(run(f"fit relu-sum k={bits} free levels",
                             ["fit", "relu-sum", "--activation", expression, "--name", name, "--bits", str(bits),
                              *FREE_LEVELS, "--out", str(out), "--no-progress"]))
            tables += [out] if steps[-1]["status"] == "ok" else []
    inv = folder / f"{name}-invact.json"
    steps.append(run("fit invact", ["fit", "invact", "--activation", expression, "--name", name, "--out", str(inv),
                                    "--no-progress"]))
    tables += [inv] if steps[-1]["status"] == "ok" else []
    if not tables:
        return steps
    steps.append(run("export", ["export", *map(str, tables)]))
    steps.append(run("cost", ["cost", *map(str, tables[:1] + tables[-1:])]))
    for family, chosen in (("relu-sum", [t for t in tables if t != inv]), ("invact", [t for t in tables if t == inv])):
        if chosen:
            steps.append(certify(family, chosen))
    for table in dict.fromkeys([tables[0], tables[-1]]):  # the first ReLU-sum (or free-level) table and the last
        try:
            steps.append(train(expression, table))
        except Exception as err:  # noqa: BLE001 - a row that says what failed
            steps.append({"step": f"patch + train ({table.stem})", "status": "failed",
                          "reason": f"{type(err).__name__}: {err}"[:300]})
    return steps


def markdown(rows: dict) -> str:
    lines = ["| activation | step | status | seconds | result or reason |", "|---|---|---|---|---|"]
    for name, steps in rows.items():
        for s in steps:
            what = " ".join(filter(None, (s.get("reason"), s.get("detail")))) or s.get("output") or (
                f"saved {s['saved_bytes'][0]:,} → {s['saved_bytes'][1]:,} bytes, loss after {TRAIN_STEPS} steps "
                f"{s['loss_patched']:.6g} vs stock {s['loss_stock']:.6g}" if "saved_bytes" in s else "")
            lines.append(f"| {name} | {s['step']} | {s['status']} | {s.get('seconds', '')} | "
                         f"{what.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=list(ACTIVATIONS), default=None)
    ap.add_argument("--docs", type=Path, default=None, help="write the table between the markers of this page")
    args = ap.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or ACTIVATIONS:
            expression, interval = ACTIVATIONS[name]
            print(f"[{len(rows) + 1}/{len(args.only or ACTIVATIONS)}] {name}: {expression}", file=sys.stderr,
                  flush=True)
            rows[name] = list(measure(name, expression, interval, Path(tmp)))
    if args.only and RESULTS.is_file():  # the other activations' rows stay as they were measured
        kept = json.loads(RESULTS.read_text())["rows"]
        rows = {name: rows.get(name, kept.get(name)) for name in ACTIVATIONS if name in rows or name in kept}
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows},
                                  indent=1) + "\n")
    if args.docs:
        text = args.docs.read_text()
        start, end = "<!-- user-activations:start -->", "<!-- user-activations:end -->"
        head, rest = text.split(start)
        args.docs.write_text(head + start + "\n" + markdown(rows) + end + rest.split(end)[1])
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
