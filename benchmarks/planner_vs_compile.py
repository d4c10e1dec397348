"""Our moves against ``torch.compile``'s ``activation_memory_budget`` on the same axes (issue 46, item 4): bytes saved
for backward at the end of the forward against the modelled step time, on real tensors on the CPU.

    python benchmarks/planner_vs_compile.py [--model llama:…] [--batch 2] [--seq 256] [--gpu h100] [--figure …]

* compile: the model under ``torch.compile`` (``aot_eager_decomp_partition``: inductor's min-cut partitioner without
  its code generation) at each ``activation_memory_budget``; the partitioner recomputes what it chooses in the
  backward.
* ours, exact: the eager model with k of its L blocks recomputed (``approxbp.planner.moves``, the first k), k = 0 … L.
* ours, approximations + exact moves: the same with ReGELU2/ReSiLU2-style ReLU-sum k = 2 activations (a gradient
  error) and MS-norms, the planner's most-saving assignment for a LLaMA block being the exact fused GLU (none).
* ours under compile: that patched model compiled at each ``activation_memory_budget`` (the combination).

Saved bytes are counted by storage identity (``kernels.saved.saved_bytes``, parameters excluded); the time of every
point is the roofline of the ops that actually run, forward and backward (``approxbp.planner.step_time.Roofline``: a
recomputed op is charged again), for the named GPU: a model, not a measurement. ``sac_ilp`` is not run: its
``SACEstimator`` times operators with ``RuntimeEstimator``, which needs a CUDA device. Writes
``benchmarks/results/planner_vs_compile.json`` and, with ``--figure``, the plot.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0)


def _model(text: str):
    from approxbp.planner.models import model_spec

    torch.manual_seed(0)
    return model_spec(text)()


def _loss(model, inputs: dict) -> torch.Tensor:
    return model(**inputs).logits.float().square().mean()


def _point(model, inputs: dict, clock, run=None) -> tuple[int, float]:
    """(bytes saved by one training forward, roofline seconds of that forward and its backward) of ``run`` (a
    compiled loss whose graphs run under ``clock``), else of the eager model under ``clock``."""
    import contextlib

    from approxbp.kernels.ops.saved import saved_bytes

    model.zero_grad(set_to_none=True)
    loss = []
    with clock if run is None else contextlib.nullcontext():  # a compiled run enters the clock in its graphs
        saved = saved_bytes(lambda: loss.append((run or functools.partial(_loss, model))(inputs)),
                            exclude=list(model.parameters()))
        loss[0].backward()
    return saved, clock.time.total


def compiled(text: str, inputs: dict, device, budgets=BUDGETS, approximate: bool = False) -> list[dict]:
    """Each budget compiled afresh; the partitioned forward and backward graphs run under the roofline
    (``aot_eager_decomp_partition_with_mode``: the same partitioner, the graphs run op by op in the mode), so a
    recomputed op is charged where it runs. ``approximate``: the model patched first (ReLU-sum k = 2 and MS-norms,
    as :func:`ours`), so the partitioner chooses among what the approximations leave (their custom ops keep their
    packed codes; the MS-norms run their stock forward, docs/models.md)."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.debugging import aot_eager_decomp_partition_with_mode

    from approxbp.planner.step_time import Roofline

    model, _ = _model(text)
    if approximate:
        from approxbp.kernels import patch_model

        patch_model(model, family="relu-sum", glu=False, example_input=inputs)
    out = []
    for budget in budgets:
        torch._dynamo.reset()
        clock = Roofline(device, type(model).__name__, [], fused=True)  # Inductor's fusion of the pointwise ops
        with functorch_config.patch(activation_memory_budget=budget):
            run = torch.compile(functools.partial(_loss, model),
                                backend=functools.partial(aot_eager_decomp_partition_with_mode, mode=clock))
            saved, seconds = _point(model, inputs, clock, run)
        out.append({"activation_memory_budget": budget, "saved_bytes": saved, "seconds": seconds})
    return out


def ours(text: str, inputs: dict, device, approximate: bool) -> list[dict]:
    from approxbp.kernels import patch_model

    from approxbp.planner.moves import apply_moves, remove_moves
    from approxbp.planner.step_memory import first_block
    from approxbp.planner.step_time import Roofline, block_paths, drop_in_paths

    model, _ = _model(text)
    if approximate:
        patch_model(model, family="relu-sum", glu=False, example_input=inputs)
    blocks = block_paths(model, first_block(model))
    out = []
    for k in range(len(blocks) + 1):
        moved = copy.deepcopy(model)
        apply_moves(moved, {b: "recompute" for b in blocks[:k]})
        saved, seconds = _point(moved, inputs, Roofline(device, type(moved).__name__, [], drop_in_paths(moved)))
        remove_moves(moved)
        out.append({"recomputed_blocks": k, "saved_bytes": saved, "seconds": seconds})
    return out


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label, marker in (("compile", "torch.compile activation_memory_budget", "o"),
                               ("ours_exact", "ours: blocks recomputed (exact)", "s"),
                               ("ours_approx", "ours: ReLU-sum k=2 + MS-norms, blocks recomputed", "^"),
                               ("compile_approx", "ours (ReLU-sum k=2 + MS-norms) under compile's budget", "D")):
        pts = result.get(key, [])
        ax.plot([p["saved_bytes"] / 2**20 for p in pts], [1e3 * p["seconds"] for p in pts], marker=marker,
                label=label)
    ax.set_xlabel("saved for backward at the end of the forward (MiB)")
    ax.set_ylabel(f"modelled step time on {result['gpu']} (ms)")
    ax.set_title(result["model"].split(":")[0] + f", batch {result['batch']}, seq {result['seq']} (a roofline model)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from approxbp.planner.gpus import gpu

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:hidden=256,layers=4,heads=4,kv_heads=4,intermediate=688,vocab=1024")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "planner_vs_compile.json")
    p.add_argument("--figure", type=Path, default=None)
    args = p.parse_args(argv)
    device = gpu(args.gpu)
    _, make_inputs = _model(args.model)
    inputs = make_inputs(args.batch, args.seq)
    result = {"model": args.model, "batch": args.batch, "seq": args.seq, "gpu": device.name, "torch": torch.__version__,
              "compile": compiled(args.model, inputs, device), "ours_exact": ours(args.model, inputs, device, False),
              "ours_approx": ours(args.model, inputs, device, True),
              "compile_approx": compiled(args.model, inputs, device, approximate=True)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for key in ("compile", "ours_exact", "ours_approx", "compile_approx"):
        for point in result[key]:
            print(key, point, file=sys.stderr)
    if args.figure:
        figure(result, args.figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
