"""Does training still work? A character-level GPT trained from the same seed on the same batches with the exact
GELU and with each memory-saving drop-in (issue 12): loss curves side by side.

    python benchmarks/train_parity.py                   # CPU, a few minutes
    python benchmarks/train_parity.py --device cuda --steps 3000 --d 256 --layers 6 --context 256

Corpus: CPython's own help texts (``pydoc_data.topics``, ~465k characters of English prose and code, in every
Python install), split 90/10 into train and validation. Model: pre-norm causal GPT (LayerNorm, causal SDPA,
Linear → GELU → Linear), AdamW, fp32 (bf16 autocast on CUDA). Variants: the exact GELU, then ``patch_model``
with ReGELU2 (ReLU-sum k = 2), ReLU-sum k = 3, InvActGELU and ReGELU2 + MS-LN (norms merged, eq. 58). Every
variant starts from the same initial weights and sees the same batches, so the curves differ only by the
backward pass. Writes ``benchmarks/results/train_parity_<device>.json`` and ``docs/figures/train_parity.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from approxbp.approximations.files import save_figure, write_atomic
from approxbp.fitting.progress import progress
from approxbp.kernels.rewrite.patch import patch_model
from torch.nn import functional as F

from approxbp.blocks import ToyGPT

ROOT = Path(__file__).resolve().parents[1]
#: label → patch_model arguments (None: the exact model, unpatched)
VARIANTS = {
    "exact GELU": None,
    "ReGELU2": dict(family="relu-sum", bits=2, norms=False),
    "ReLU-sum k=3": dict(family="relu-sum", bits=3, norms=False),
    "InvActGELU": dict(family="invact", norms=False),
    "ReGELU2 + MS-LN": dict(family="relu-sum", bits=2, norms=True),
}


def corpus() -> str:
    """CPython's help() topics, in a fixed order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distributions strip pydoc_data
        raise SystemExit(f"this Python has no pydoc_data ({err}); train_parity needs its help texts") from err
    return "\n\n".join(topics[k] for k in sorted(topics))


def _batch(data: torch.Tensor, batch: int, context: int, g: torch.Generator):
    i = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
    rows = torch.stack([data[j:j + context + 1] for j in i.tolist()])
    return rows[:, :-1], rows[:, 1:]


def train(variant: str, train_data, val_data, vocab: int, args, device: str) -> dict:
    """Train one variant; returns its train-loss and validation-loss curves."""
    torch.manual_seed(args.seed)
    model = ToyGPT(vocab, args.d, args.layers, args.heads, args.context)
    patch = VARIANTS[variant]
    if patch is not None:
        patch_model(model, example_input=torch.zeros(1, args.context, dtype=torch.long), **patch)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every variant
    autocast = torch.autocast(device, torch.bfloat16, enabled=device == "cuda")
    out = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    for step in progress(range(1, args.steps + 1), desc=variant, every=30):
        xb, yb = (t.to(device) for t in _batch(train_data, args.batch, args.context, g))
        with autocast:
            loss = F.cross_entropy(model(xb).flatten(0, 1).float(), yb.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out["step"].append(step)
        out["train_loss"].append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            out["val_step"].append(step)
            out["val_loss"].append(evaluate(model, val_data, args, device, autocast))
    return out


@torch.no_grad()
def evaluate(model, val_data, args, device, autocast) -> float:
    """Mean loss over fixed validation windows (the same for every variant and every call)."""
    model.eval()
    g = torch.Generator().manual_seed(12345)
    losses = []
    for _ in range(args.val_batches):
        xb, yb = (t.to(device) for t in _batch(val_data, args.batch, args.context, g))
        with autocast:
            losses.append(F.cross_entropy(model(xb).flatten(0, 1).float(), yb.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    window = max(1, len(next(iter(result["runs"].values()))["train_loss"]) // 50)
    for label, run in result["runs"].items():
        t = torch.tensor(run["train_loss"])
        smooth = t.unfold(0, window, 1).mean(1) if len(t) >= window else t
        ax_t.plot(run["step"][window - 1:] if len(t) >= window else run["step"], smooth, label=label, lw=1)
        ax_v.plot(run["val_step"], run["val_loss"], marker=".", label=label, lw=1)
    ax_t.set(title=f"train loss (running mean of {window})", xlabel="step", ylabel="cross-entropy (nats/char)")
    ax_v.set(title="validation loss", xlabel="step")
    ax_v.legend()
    cfg = result["config"]
    fig.suptitle(f"char-level GPT on CPython's help texts: d={cfg['d']}, {cfg['layers']} layers, "
                 f"context {cfg['context']}, batch {cfg['batch']} ({result['device']})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON [benchmarks/results/train_parity_<device>.json]")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "train_parity.png")
    args = p.parse_args(argv)
    text = corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({platform.machine()})"
    result = {"device": device_name, "torch": torch.__version__, "corpus": "pydoc_data.topics",
              "corpus_chars": len(text), "vocab": len(chars),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "figure", "variants", "device")},
              "runs": {}}
    for variant in args.variants:
        result["runs"][variant] = train(variant, data[:split], data[split:], len(chars), args, args.device)
    result["final_val_loss"] = {v: r["val_loss"][-1] for v, r in result["runs"].items()}
    tag = "cpu" if args.device == "cpu" else torch.cuda.get_device_name().replace(" ", "_")
    out = args.out or ROOT / "benchmarks" / "results" / f"train_parity_{tag}.json"
    write_atomic(out, json.dumps(result, indent=1))
    plot(result, args.figure)
    exact = result["final_val_loss"].get("exact GELU")
    for v, loss in result["final_val_loss"].items():
        rel = "" if exact is None else f"  ({loss - exact:+.4f} vs exact)"
        print(f"{v:>16}: final validation loss {loss:.4f}{rel}")
    print(f"wrote {out} and {args.figure}")
    return result


if __name__ == "__main__":
    main()
