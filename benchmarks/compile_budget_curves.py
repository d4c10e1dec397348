"""``torch.compile``'s ``activation_memory_budget`` on the issue's three big set-ups (issue 46, item 4), beside our
``--pareto`` curves on the same axes: modelled peak against modelled step time, on fake tensors.

    python benchmarks/compile_budget_curves.py [--only vitb_full,…] [--figure-dir docs/figures]

Each set-up is built as ``approxbp plan`` builds it (its ``Setup``, fake tensors) at 2 and 3 blocks and compiled
with inductor's partitioner (``aot_eager_decomp_partition_with_mode``: the partitioned forward and backward graphs
run op by op under the roofline, so a recomputed op is charged where it runs, pointwise ops between library calls
as Inductor's fused kernels) at each budget; the bytes saved at the end of the forward and the step's time are
extrapolated linearly in the blocks to the model's depth, as the planner extrapolates its own measurements
(:mod:`approxbp.planner.extrapolate`). The eager exact model is measured the same way, so compile's peak is our exact
peak (the ``--pareto`` curve's first point: weights, gradients, optimizer, activations) with the eager saved bytes
replaced by compile's. Everything is a model for the named GPU, not a measurement. Writes
``benchmarks/results/compile_budget_curves.json`` and, with ``--figure-dir``, one figure per set-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = ("qwen3:hidden_size=4096,num_hidden_layers=36,intermediate_size=12288,num_attention_heads=32,"
            "num_key_value_heads=8,head_dim=128,vocab_size=151936")
#: name → (model, batch, seq, set-up keywords, LoRA rank): the commands of docs/memory.md's three curves.
SETUPS = {
    "llama7b_lora_seq4096": ("huggyllama/llama-7b", 1, 4096, {"train": "lora"}, 8),
    "vitb_full": ("google/vit-base-patch16-224-in21k", 64, 512, {"task": "image-cls"}, 8),
    "qwen3_8b_qlora": (QWEN3_8B, 1, 2048, {"weights": "nf4", "train": "lora", "lora_targets": "all-linear"}, 64),
}


class LiveBytes(TorchDispatchMode):
    """The most bytes of storages that ops made while it was active and that were alive at once (each storage
    counted once, freed when its last tensor is; fake tensors alike): a step's transient peak, activations and
    temporaries and gradients, above what existed before."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self._tensors = 0, 0, {}  # storage id → [tensors alive, bytes]

    def _free(self, key):
        entry = self._tensors[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._tensors[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in self._tensors:
                    self._tensors[key] = [0, t.untyped_storage().nbytes()]
                    self.live += self._tensors[key][1]
                    self.peak = max(self.peak, self.live)
                self._tensors[key][0] += 1
                weakref.finalize(t, self._free, key)
        return out


def curve(name: str, device, budgets=None) -> dict:
    """Compile's points for one set-up at ``budgets`` (default :data:`~.compiled.BUDGETS`), extrapolated from
    2 and 3 blocks, with the eager exact model's."""
    from approxbp.planner.compiled import BUDGETS
    from approxbp.planner.extrapolate import layer_count
    from approxbp.planner.models import model_spec
    from approxbp.planner.training import Setup

    model_text, batch, seq, keywords, lora_r = SETUPS[name]
    setup = Setup(**keywords)
    depth = layer_count(model_spec(model_text, setup.task).config)[1]

    from approxbp.planner.compiled import point
    from approxbp.planner.request import Request

    def measured(budget, blocks):
        """(saved bytes, seconds, :class:`LiveBytes`' peak) of one step cut to ``blocks``, compiled once for all
        three. The live peak is op by op: a backward that recomputes what the partitioner dropped rebuilds it all
        at once, where a block recompute rebuilds one block."""
        alive = LiveBytes()
        request = Request(model=model_text, batch=batch, seq=seq, setup=setup, lora_r=lora_r)
        return (*point(request, device, {}, False, budget, (blocks, depth), watch=alive), alive.peak)

    def extrapolated(budget):
        (saved2, seconds2, alive2), (saved3, seconds3, alive3) = (measured(budget, n) for n in (2, 3))
        return {"saved_bytes": saved3 + (depth - 3) * (saved3 - saved2),
                "seconds": seconds3 + (depth - 3) * (seconds3 - seconds2),
                "alive_op_by_op_at_2_and_3_blocks": [alive2, alive3]}

    eager = extrapolated(None)
    points = []
    for budget in budgets or BUDGETS:
        points.append({"activation_memory_budget": budget, **extrapolated(budget)})
        print(f"[{name}] budget {budget}: saved {points[-1]['saved_bytes'] / 2**30:.2f} GiB, "
              f"{1e3 * points[-1]['seconds']:.1f} ms", file=sys.stderr)
    return {"model": model_text, "batch": batch, "seq": seq, "setup": keywords, "lora_r": lora_r, "blocks": depth,
            "eager_exact": eager, "compile": points}


def with_ours(result: dict, pareto: dict) -> dict:
    """Compile's points as peaks on our axes: our exact peak with the eager saved bytes replaced by compile's (the
    end of the forward, what the budget controls; our planner's own model of a step without moves). Compile's
    backward transient is not in it: a budget below 1 recomputes in one backward graph what it dropped, where a
    block recompute rebuilds one block; ``alive_op_by_op_at_2_and_3_blocks`` (:class:`LiveBytes`, the graphs run
    op by op as aot_eager runs them, which keeps the backward's inputs to its end where Inductor frees them as it
    goes) shows it on the small models, not extrapolated (the partitioner's choices differ between 2 and 3
    blocks)."""
    exact = pareto["curve"][0]["peak"]
    for p in result["compile"]:
        p["peak"] = exact - result["eager_exact"]["saved_bytes"] + p["saved_bytes"]
    result["ours"] = pareto["curve"]
    return result


def figure(name: str, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label, marker in (("ours", "approxbp plan --pareto (eager: approximations and moves)", "o"),
                               ("compile", "torch.compile activation_memory_budget (fused)", "s"),
                               ("ours_with_compile", "approxbp plan --pareto --compile-budgets (compile as a move)",
                                "x")):
        pts = result.get(key)
        if not pts:
            continue
        ax.plot([p["peak"] / 2**30 for p in pts], [1e3 * p["seconds"] for p in pts], marker=marker, label=label)
    ax.set_xlabel("modelled peak (GiB)")
    ax.set_ylabel(f"modelled step time on {result['gpu']} (ms)")
    ax.set_title(f"{name}: a roofline model on fake tensors", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from approxbp.planner.gpus import gpu

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SETUPS), help="comma-separated set-ups (default: all three)")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile_budget_curves.json")
    p.add_argument("--figure-dir", type=Path, default=None)
    args = p.parse_args(argv)
    device = gpu(args.gpu)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in args.only.split(","):
        result = curve(name, device)
        result["gpu"] = device.name
        pareto = ROOT / "benchmarks" / "results" / f"pareto_{name}_{args.gpu}.json"
        results[name] = with_ours(result, json.loads(pareto.read_text()))
        with_compile = pareto.with_name(f"pareto_{name}_compile_{args.gpu}.json")
        if with_compile.exists():  # the curve with compile's budget as one of the planner's moves
            results[name]["ours_with_compile"] = json.loads(with_compile.read_text())["curve"]
        if args.figure_dir:
            figure(name, results[name], args.figure_dir / f"compile_budget_{name}.png")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
