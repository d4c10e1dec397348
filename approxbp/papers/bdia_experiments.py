"""BDIA error analysis (BDIA-transformer §4.3, Figs. 2 and 6) and a small BDIA-GPT trained on the CPU.

    reconstruction_errors   max |x̂_k − x_k| per block, online inversion with eq. 16 (plain) or eq. 24 (quantised)
    forward_quantisation    ‖x_K(eq. 21) − x_K(eq. 10)‖ / ‖x_K(eq. 10)‖ vs l and K, same γ
    memory_per_block        saved-activation bytes, ordinary autograd vs online BDIA, via saved_tensors_hooks
    analyze                 all of the above as one JSON-able dict; plot_analysis draws it
    train_toy_gpt           standard vs BDIA training of a GPT-style toy on a generated corpus
"""

from __future__ import annotations

import math
import time

import torch

from approxbp.approximations import bdia as B
from approxbp.approximations.files import save_figure, write_atomic
from approxbp.blocks import ToyGPT, own_rng

__all__ = ["analyze", "arithmetic_corpus", "forward_quantisation", "LEVELS", "memory_per_block", "plot_analysis",
           "plot_toy_gpt", "RandomBranch", "reconstruction_errors", "reproduce_row", "ToyMLP", "train_toy_gpt",
           "VOCAB", "write_analysis", "write_toy_gpt"]


# -- random residual branches ------------------------------------------------------------------
class RandomBranch(torch.nn.Module):
    """h(x) = c·tanh(LN(x)·W/√d): a bounded, normalised residual branch (|h| ≤ c), as in a pre-norm block."""

    def __init__(self, d: int, generator: torch.Generator, c: float = 0.1):
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(d, d, generator=generator, dtype=torch.float64) / d**0.5)
        self.c = c

    def forward(self, x):
        x = torch.nn.functional.layer_norm(x, x.shape[-1:])
        return self.c * torch.tanh(x @ self.W.to(x.dtype))


def _random_branches(K: int, d: int, seed: int) -> list[RandomBranch]:
    g = torch.Generator().manual_seed(seed)
    return [RandomBranch(d, g) for _ in range(K)]


def _inputs(batch: int, d: int, seed: int, dtype) -> torch.Tensor:
    return torch.randn(batch, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)


@torch.no_grad()
def reconstruction_errors(K: int, dtype=torch.float32, level: int | None = None, d: int = 64, batch: int = 8,
                          seed: int = 0) -> list[float]:
    """Max |x̂_k − x_k| for k = K−2 … 0 after online inversion from (x_{K−1}, x_K); index i is block k = i.

    ``level=None``: the plain update (eq. 10) and inverse (eq. 16), errors ×2 per block (Fig. 2, red);
    an integer l: eqs. 18–21 with side bits and eq. 24, exactly zero (Fig. 2, blue). Non-finite → inf.
    """
    hs = [h.to(dtype) for h in _random_branches(K, d, seed)]
    gam = B.draw_gammas(seed, K, batch).to(dtype)
    xs, sides = B.run(hs, _inputs(batch, d, seed, dtype), gam, level)
    errs = [0.0] * (K - 1)
    a, b = xs[-2], xs[-1]
    for k in range(K - 1, 0, -1):
        g = B.per_sample(gam[k - 1], a)
        prev = (B.plain_inverse(a, b, hs[k](a), g) if level is None
                else B.inverse(a, b, hs[k](a), sides[k - 1], g, level, k))
        e = float((prev.double() - xs[k - 1].double()).abs().max())
        errs[k - 1] = e if math.isfinite(e) else math.inf
        a, b = prev, a
    return errs


@torch.no_grad()
def forward_quantisation(K: int, level: int, dtype=torch.float64, d: int = 64, batch: int = 8,
                         seed: int = 0) -> list[float]:
    """Relative error ‖x_k(eqs. 18–21) − x_k(eqs. 6, 10)‖₂ / ‖x_k(eq. 10)‖₂ for k = 1…K, same branches and γ."""
    hs = [h.to(dtype) for h in _random_branches(K, d, seed)]
    gam = B.draw_gammas(seed, K, batch).to(dtype)
    x = _inputs(batch, d, seed, dtype)
    plain, quantised = B.run(hs, x, gam)[0], B.run(hs, x, gam, level)[0]
    return [float((q - p).norm() / p.norm()) for p, q in zip(plain[1:], quantised[1:], strict=True)]


@own_rng
def memory_per_block(K: int = 12, d: int = 256, tokens: int = 1024, dtype=torch.float32, level: int = 9) -> dict:
    """Saved-activation bytes per block of a pre-norm MLP stack: ordinary autograd vs online BDIA."""
    from approxbp.kernels.ops.bdia import BDIAStack
    from approxbp.kernels.ops.saved import saved_bytes

    torch.manual_seed(0)
    blocks = [ToyMLP(d).to(dtype) for _ in range(K)]
    params = [p for b in blocks for p in b.parameters()]
    x = torch.randn(tokens, d, dtype=dtype, requires_grad=True)
    plain = saved_bytes(lambda: BDIAStack(blocks, level, online=False)(x, seed=0), exclude=params)
    online = saved_bytes(lambda: BDIAStack(blocks, level, online=True, preserve_rng=False)(x, seed=0), exclude=params)
    n = tokens * d
    return {"blocks": K, "d": d, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
            "autograd_bytes_per_block": plain / K, "online_bytes_per_block": online / K,
            "side_bits_bytes_per_block": math.ceil(n / 8) * (K - 1) / K,
            "autograd_bytes_per_element_per_block": plain / K / n, "online_bytes_per_element_per_block": online / K / n}


class ToyMLP(torch.nn.Module):
    """Pre-norm MLP residual branch h(x) = W₂ GELU(W₁ LN(x))."""

    def __init__(self, d: int, mult: int = 4, dropout: float = 0.0):
        super().__init__()
        self.ln, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, mult * d), torch.nn.Linear(mult * d, d)
        self.drop = torch.nn.Dropout(dropout)
        torch.nn.init.normal_(self.down.weight, std=0.02 / math.sqrt(2))

    def forward(self, x):
        return self.drop(self.down(torch.nn.functional.gelu(self.up(self.ln(x)))))


LEVELS = (-2, 0, 5, 9, 12)


def analyze(blocks: int = 1000, levels=LEVELS, dtypes=(torch.float32, torch.float64), seed: int = 0,
            progress: bool = True) -> dict:
    """Everything `approxbp bdia analyze` writes: reconstruction (a, b), forward quantisation (c), memory (d)."""
    from approxbp.fitting.progress import progress as tqdm

    jobs = [(dt, None) for dt in dtypes] + [(dt, lv) for dt in dtypes for lv in levels]
    recon = {}
    for dt, lv in tqdm(jobs, desc="reconstruction", enabled=progress):
        name = str(dt).removeprefix("torch.")
        try:
            errs = reconstruction_errors(blocks, dt, lv, seed=seed)
        except ValueError as e:  # a level too fine for the dtype's exactness bound
            recon[f"{name}/l={lv}"] = {"error": str(e)}
            continue
        recon[f"{name}/{'plain' if lv is None else f'l={lv}'}"] = {
            "max_error_by_block": [e if math.isfinite(e) else None for e in errs],
            "max_error": max(errs) if all(map(math.isfinite, errs)) else None,
            "first_nonfinite_block": next((k for k in range(len(errs) - 1, -1, -1) if not math.isfinite(errs[k])),
                                          None)}
    quant = {f"l={lv}": forward_quantisation(min(blocks, 96), lv, seed=seed)
             for lv in tqdm(levels, desc="forward quantisation", enabled=progress)}
    return {"blocks": blocks, "seed": seed, "reconstruction": recon, "forward_quantisation": quant,
            "memory": memory_per_block(), "bounds": {str(dt).removeprefix("torch."): {lv: B.bound(dt, lv)
                                                                                       for lv in levels}
                                                     for dt in (torch.float64, torch.float32, torch.float16,
                                                                torch.bfloat16)}}


def reproduce_row(seed: int = 0) -> dict:
    """The paper's Fig. 2 setting: K = 12 blocks, l = 9, fp32: max reconstruction error without/with quantisation."""
    return {"blocks": 12, "level": 9, "plain": max(reconstruction_errors(12, torch.float32, None, seed=seed)),
            "quantised": max(reconstruction_errors(12, torch.float32, 9, seed=seed))}


def plot_analysis(result: dict):
    """Fig. 2/6 extended: reconstruction error vs block (log), forward quantisation vs block per l, memory."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.4))
    (a, b, c) = fig.subplots(1, 3)
    floor, cap = 1e-18, 1e40  # exact zeros drawn at the floor, inf (overflow) at the cap
    K = result["blocks"]
    exact = []
    for key, r in result["reconstruction"].items():
        if "max_error_by_block" not in r:
            continue
        e = [math.inf if v is None else v for v in r["max_error_by_block"]]
        back = list(range(len(e)))[::-1]  # index k ↦ blocks inverted so far, K−1−(k+1)
        if key.endswith("plain"):
            a.semilogy(back, [min(max(v, floor), cap) for v in e], lw=2,
                       label=f"{key.split('/')[0]}: eq. 16, no quantisation (×2 per block)")
        elif max(e) == 0.0:
            exact.append(key)
        else:
            a.semilogy(back, [min(max(v, floor), cap) for v in e], ":", label=f"{key}: eq. 24 NOT exact")
    if exact:
        a.semilogy([0, K], [floor, floor], "k--", lw=2,
                   label=f"eq. 24 + side bits: exactly 0 ({len(exact)} runs: fp32/fp64 × l ∈ {{−2, 0, 5, 9, 12}})")
    a.set_ylim(floor / 10, cap * 10)
    a.set_xlim(0, min(K, 300))
    a.set_xlabel("blocks reconstructed from (x_{K−1}, x_K)")
    a.set_ylabel("max |x̂_k − x_k|  (0 at 1e-18, overflow at 1e40)")
    a.set_title(f"Reconstruction error, K = {K} random blocks (first 300 shown)")
    a.legend(fontsize=7.5)
    for key, q in result["forward_quantisation"].items():
        b.semilogy(range(1, len(q) + 1), q, label=key)
    b.set_xlabel("block k")
    b.set_ylabel("‖x_k(eq. 21) − x_k(eq. 10)‖ / ‖x_k(eq. 10)‖")
    b.set_title("Forward error of activation quantisation (fp64)")
    b.legend(fontsize=8)
    m = result["memory"]
    bars = {"ordinary autograd": m["autograd_bytes_per_element_per_block"],
            "online BDIA": m["online_bytes_per_element_per_block"]}
    c.bar(list(bars), list(bars.values()), color=["C7", "C2"])
    for i, v in enumerate(bars.values()):
        c.text(i, v, f"{v:.3f}", ha="center", va="bottom")
    c.set_ylabel(f"saved bytes per element per block ({m['dtype']})")
    c.set_title(f"Memory: pre-norm MLP blocks, K = {m['blocks']}, d = {m['d']}")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# -- a small BDIA-GPT on a generated corpus ----------------------------------------------------------
def arithmetic_corpus(n: int, seed: int = 0) -> str:
    """``n`` lines "a+b=c" with a, b < 100: a character-level corpus generated from a seed, no download."""
    g = torch.Generator().manual_seed(seed)
    ab = torch.randint(0, 100, (n, 2), generator=g).tolist()
    return "".join(f"{a}+{b}={a + b}\n" for a, b in ab)


VOCAB = "0123456789+=\n"


@own_rng
def train_toy_gpt(steps: int = 300, blocks: int = 6, d: int = 128, batch: int = 16, context: int = 64,
                  level: int = 9, seed: int = 0, check_every: int = 50, progress: bool = True) -> dict:
    """Standard vs BDIA (γ ∈ {±0.5}, l) training from the same init and batches; returns curves and memory.

    Exactness is checked at every block of every BDIA step (the online backward compares each recomputed
    x_{k+1} with the forward's bit for bit and raises otherwise); every ``check_every`` steps the online
    gradients are also compared bitwise with ordinary autograd through the same quantised forward.
    """
    from approxbp.fitting.progress import progress as tqdm
    from approxbp.kernels.ops.saved import saved_bytes

    text = arithmetic_corpus(6000, seed)
    data = torch.tensor([VOCAB.index(ch) for ch in text])
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]

    def batch_of(src, g):
        i = torch.randint(0, len(src) - context - 1, (batch,), generator=g)
        return (torch.stack([src[j:j + context] for j in i.tolist()]),
                torch.stack([src[j + 1:j + context + 1] for j in i.tolist()]))

    out: dict = {"config": {"steps": steps, "blocks": blocks, "d": d, "batch": batch, "context": context,
                            "level": level, "seed": seed, "corpus": "arithmetic_corpus(6000)"}}
    for name in ("standard", "bdia"):
        torch.manual_seed(seed)
        model = ToyGPT(len(VOCAB), d, blocks, heads=4, context=context, dropout=0.1,
                       bdia_level=level if name == "bdia" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g, gv = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
        curve, val_curve, checks, t0 = [], [], 0, time.perf_counter()
        for it in tqdm(range(steps), desc=f"toy GPT ({name})", enabled=progress):
            xb, yb = batch_of(train, g)
            model.train()
            rng = torch.get_rng_state()
            loss = torch.nn.functional.cross_entropy(model(xb, seed=it).flatten(0, 1), yb.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if name == "bdia" and check_every and it % check_every == 0:
                checks += _grads_equal_autograd(model, xb, yb, it, rng)
            opt.step()
            curve.append(loss.item())
            if it % 25 == 0 or it == steps - 1:
                model.eval()
                with torch.no_grad():
                    xv, yv = batch_of(val, gv)
                    val_curve.append((it, float(torch.nn.functional.cross_entropy(model(xv).flatten(0, 1),
                                                                                   yv.flatten()))))
        model.train()
        xb, yb = batch_of(train, torch.Generator().manual_seed(0))
        params = list(model.parameters())
        mem = saved_bytes(lambda m=model, xb=xb: m(xb, seed=0), exclude=params)
        out[name] = {"train_loss": curve, "val_loss": val_curve, "saved_bytes_per_step": mem,
                     "seconds": time.perf_counter() - t0,
                     **({"bitwise_gradient_checks_passed": checks} if name == "bdia" else {})}
    return out


def _grads_equal_autograd(model, xb, yb, seed: int, rng_before: torch.Tensor) -> int:
    """Recompute the step's gradients with ordinary autograd (same RNG, same γ) and require bitwise equality."""
    online = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    model.stack.online = False
    try:
        for p in model.parameters():
            p.grad = None
        torch.set_rng_state(rng_before)
        loss = torch.nn.functional.cross_entropy(model(xb, seed=seed).flatten(0, 1), yb.flatten())
        loss.backward()
    finally:
        model.stack.online = True
        torch.set_rng_state(rng)
    same = all(torch.equal(a, p.grad) for a, p in zip(online, model.parameters(), strict=True))
    for a, p in zip(online, model.parameters(), strict=True):
        p.grad = a
    if not same:
        raise RuntimeError(f"step {seed}: online BDIA gradients differ from ordinary autograd")
    return 1


def plot_toy_gpt(result: dict):
    """Training and validation loss, standard vs BDIA, and saved-activation bytes per step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.2))
    (a, b) = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    for name, color in (("standard", "C0"), ("bdia", "C3")):
        r = result[name]
        label = "standard residual" if name == "standard" else f"BDIA (γ ∈ ±0.5, l = {result['config']['level']})"
        a.plot(r["train_loss"], color=color, alpha=0.35, lw=0.8)
        it, v = zip(*r["val_loss"], strict=True)
        a.plot(it, v, color=color, lw=2, label=f"{label}: validation")
    a.set_xlabel("training step")
    a.set_ylabel("cross-entropy (nats/char); thin = train")
    c = result["config"]
    a.set_title(f"Toy GPT, {c['blocks']} blocks, d = {c['d']}, arithmetic corpus (CPU)")
    a.legend()
    mib = [result[n]["saved_bytes_per_step"] / 2**20 for n in ("standard", "bdia")]
    b.bar(["standard", "BDIA online"], mib, color=["C0", "C3"])
    for i, v in enumerate(mib):
        b.text(i, v, f"{v:.1f} MiB", ha="center", va="bottom")
    b.set_ylabel("saved activations per step (MiB, fp32)")
    b.set_title(f"batch {c['batch']} × {c['context']} tokens")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_analysis(out, blocks: int = 1000, levels=LEVELS, dtypes=(torch.float32, torch.float64), seed: int = 0,
                   progress: bool = True) -> list:
    """`approxbp bdia analyze`: bdia_analysis.json and bdia_analysis.png under ``out``."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = analyze(blocks, levels, dtypes, seed, progress)
    write_atomic(out / "bdia_analysis.json", json.dumps(result, indent=1) + "\n")
    save_figure(plot_analysis(result), out / "bdia_analysis.png", dpi=110)
    return [out / "bdia_analysis.json", out / "bdia_analysis.png"]


def write_toy_gpt(out, results_json=None, progress: bool = True, **kwargs) -> list:
    """`approxbp bdia train-toy`: train (or re-plot ``results_json``) and write the JSON and the figure."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if results_json is not None and Path(results_json).exists():
        result = json.loads(Path(results_json).read_text())
        written = []
    else:
        result = train_toy_gpt(progress=progress, **kwargs)
        written = [out / "bdia_toy_gpt.json"]
        write_atomic(written[0], json.dumps(result) + "\n")
    save_figure(plot_toy_gpt(result), out / "bdia_toy_gpt.png", dpi=110)
    return [*written, out / "bdia_toy_gpt.png"]
