"""Error atlas: backward-pass error per bit of saved memory, for every family (Inverted Activations
Fig. 5, extended with the ReLU-sum tables).

All errors are of the derivative used in backward, e(x) = f'(x) − d(x), on x ∈ [−8, 8]:
  fewbit-k   optimal 2^k-level quantiser of the values f'(x) (Lloyd iteration; FewBit-style), k bits
  relu-sum-k the fitted step derivative h̃' of the committed tables, k bits
  invact     q_branch(f(x)) from the `fast` form (the kernels'), the `newton` reference and the published tables,
             1 bit (the branch flag)
under two weightings: uniform on [−8, 8], and N(0, 1). L2 = (∫ e² w / ∫ w)^{1/2}, L∞ = max |e| (uniform).

Tables come from the package; for any other activation they are fitted once and kept in a cache folder
(``write_atlas``: ``<out>/atlas_tables``), so a second atlas of the same expression reads them back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from approxbp.approximations import ReLUSum, get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.files import safe_stem, save_figure, write_atomic
from approxbp.approximations.invact import InvertedActivation
from approxbp.approximations.invact_forms import TableBackward

__all__ = ["atlas", "BITS", "plot_atlas", "STEPS", "WEIGHTS", "work", "write_atlas", "X"]


X = np.linspace(-8.0, 8.0, 32001)
WEIGHTS = {"uniform": np.ones_like(X), "normal": np.exp(-X * X / 2)}


def _lloyd_levels(values: np.ndarray, weights: np.ndarray, bits: int, iterations: int = 300) -> np.ndarray:
    """Optimal 2^k reconstruction levels for the weighted scalar data ``values`` (1-D Lloyd–Max)."""
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cdf = np.cumsum(w) / w.sum()
    levels = np.interp((np.arange(2**bits) + 0.5) / 2**bits, cdf, v)  # start at weighted quantiles
    for _ in range(iterations):
        borders = (levels[1:] + levels[:-1]) / 2
        idx = np.searchsorted(borders, v)
        num = np.bincount(idx, w * v, levels.size)
        den = np.bincount(idx, w, levels.size)
        new = np.where(den > 0, num / np.where(den > 0, den, 1), levels)
        if np.allclose(new, levels, rtol=0, atol=1e-15):
            break
        levels = np.sort(new)
    return levels


def _quantise(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    return levels[np.searchsorted((levels[1:] + levels[:-1]) / 2, values)]


def _errors(e: np.ndarray) -> dict:
    out = {"linf": float(np.max(np.abs(e)))}
    for name, w in WEIGHTS.items():
        out[f"l2_{name}"] = float(np.sqrt(np.sum(w * e * e) / np.sum(w)))
    return out


def _table(folder: str, stem: str, cache: Path | None, make, what: str):
    """The packaged table ``folder/stem``; else the one in ``cache``; else ``make()``, saved to ``cache``, with a
    note on stderr."""
    try:
        return table_files.load(f"{folder}/{stem}")
    except FileNotFoundError:
        pass
    cached = cache / folder / f"{safe_stem(stem)}.json" if cache is not None else None
    if cached is not None and cached.is_file():
        return table_files.load(cached)
    print(f"atlas: no table for {what}: fitting it now" + (f" (kept in {cache})" if cache else ""), file=sys.stderr)
    table = make()
    if cached is not None:
        table_files.save(table, cached, overwrite=True)
    return table


#: The ReLU-sum bit-widths of an atlas (``--bits``; the FewBit-style curves, which fit nothing, always span 1…8).
BITS = range(1, 9)
#: Tables per activation: ReLU-sum k = 1…8 for both objectives, and the InvAct fast form.
STEPS = len(BITS) * 2 + 1
#: A table's share of the work, for the time left: a ReLU-sum fit at k costs about k² (measured on two cores: 2 s at
#: k = 2, 12 s at 4, 26 s at 6, per objective), InvAct's fast form about k = 4.5's.
_INVACT_WORK = 20


def work(bits=BITS) -> int:
    """The progress units of one activation's tables (each ReLU-sum table k², the InvAct fit :data:`_INVACT_WORK`)."""
    return 2 * sum(k * k for k in bits) + _INVACT_WORK


def atlas(activation, cache: Path | None = None, bar=None, bits=BITS) -> list[dict]:
    """Rows {family, bits, label, linf, l2_uniform, l2_normal} for one activation (a registry name, an expression
    or an Activation, e.g. from ``named_activation``), its ReLU-sum tables at ``bits``; tables fitted for it are
    kept in ``cache``; ``bar`` (a :func:`~.progress.progress` bar) advances by each table's share of the work
    (:func:`work`: a k = 8 fit takes 64 times a k = 1 fit, so the time left holds)."""
    from .invact import fit_invact
    from .relu_sum import fit_relu_sum

    act = get_activation(activation)
    d = act.df(X)
    rows = []
    for k in range(1, 9):
        for wname, w in WEIGHTS.items():
            e = d - _quantise(d, _lloyd_levels(d, w, k))
            rows.append({"family": f"fewbit-{wname}", "bits": k, "label": f"FewBit-style {k}-bit ({wname} weight)",
                         **_errors(e)})
        for objective in ("primitive", "derivative") if k in bits else ():
            t = _table("relu_sum", table_files.relu_sum_name(act.name, k, objective), cache,
                       lambda k=k, o=objective: fit_relu_sum(act, k, o, progress=False).table,
                       f"{act.name!r} k={k} {objective}")
            rs = ReLUSum(t.weights, t.knots)
            if bar is not None:
                bar.update(k * k)
            rows.append({"family": f"relu-sum-{objective}", "bits": k,
                         "label": f"ReLU-sum k={k} ({objective})", **_errors(d - rs.derivative(X))})
    ia = InvertedActivation(act)
    left = X < ia.T
    fx = act.f(X)
    fx[left] = np.maximum(fx[left], ia.f_T)  # y as saved: never below the minimum
    for form in ("paper", "released", "newton", "fast"):
        if form != "fast":  # the published forms and the reference: packaged only
            try:
                t = table_files.load(f"invact/{act.name}-{form}")
            except FileNotFoundError:
                continue
        else:  # the kernels' form: fitted (and kept) for any activation
            fit = lambda: fit_invact(act, "fast").table  # noqa: E731
            t = _table("invact", f"{act.name}-fast", cache, fit, f"{act.name!r} InvAct")
            if bar is not None:
                bar.update(_INVACT_WORK)
        q = TableBackward(t)(torch.from_numpy(fx), torch.from_numpy(left)).numpy()  # float64: the kernels' rule
        rows.append({"family": f"invact-{form}", "bits": 1, "label": f"InvAct ({form})", **_errors(d - q)})
    return rows


def write_atlas(out: Path, activations=("gelu", "silu"), progress: bool = False, bits=BITS) -> list[Path]:
    """Data (JSON) and one figure per activation: error vs saved bits per element, log scale, the ReLU-sum tables
    at ``bits``. Tables fitted for activations the package lacks are kept in ``out/atlas_tables`` and reused.
    ``progress``: the tables' work (:func:`work`) with the time left (a bar on a terminal, a line every 10 s in a
    log)."""
    from .progress import progress as bar_of

    out.mkdir(parents=True, exist_ok=True)
    acts = [get_activation(a) for a in activations]
    bar = bar_of(total=work(bits) * len(acts), desc="atlas tables (work: k² per fit)", enabled=progress,
                 unit="unit")
    data = {a.name: atlas(a, out / "atlas_tables", bar, bits) for a in acts}
    bar.close()
    paths = [out / "error_atlas.json"]
    write_atomic(paths[0], json.dumps({"x_range": [-8, 8], "points": X.size, "rows": data}, indent=1) + "\n")
    for a, rows in data.items():
        fig = plot_atlas(a, rows)
        p = out / f"error_atlas_{safe_stem(a)}.png"  # a may be a whole expression
        save_figure(fig, p, dpi=110)
        paths.append(p)
    return paths


def plot_atlas(a: str, rows: list[dict] | None = None):
    """Error of the backward derivative vs saved bits per element, every family, for one activation."""
    from matplotlib.figure import Figure

    rows = atlas(a) if rows is None else rows
    styles = {"fewbit-uniform": ("C0", "o-"), "fewbit-normal": ("C9", "o--"), "relu-sum-primitive": ("C2", "s-"),
              "relu-sum-derivative": ("C8", "s--"), "invact-paper": ("C3", "*"), "invact-released": ("C1", "P"),
              "invact-newton": ("C4", "D"), "invact-fast": ("C5", "X")}
    names = {"fewbit-uniform": "FewBit-style k-bit (uniform weight)",
             "fewbit-normal": "FewBit-style k-bit (N(0,1) weight)",
             "relu-sum-primitive": "ReLU-sum, ours (primitive obj., eq. 14)",
             "relu-sum-derivative": "ReLU-sum, ours (derivative obj., eq. 63)",
             "invact-paper": "InvAct, paper's eqs. 5–8", "invact-released": "InvAct, authors' released constants",
             "invact-newton": "InvAct, ours (newton, the reference)",
             "invact-fast": "InvAct, ours (fast, the kernels')"}
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for ax, metric, title in ((axes[0], "l2_normal", "L2 error, N(0,1)-weighted"),
                              (axes[1], "linf", "L∞ error on x ∈ [−8, 8]")):
        for fam, (color, style) in styles.items():
            pts = [(r.get("bits"), r[metric]) for r in rows if r.get("family") == fam]  # result rows
            if pts:
                b, v = zip(*pts)
                if len(pts) == 1:  # the 1-bit InvAct markers side by side, not on top of each other
                    b = (1 + {"invact-paper": -0.12, "invact-released": -0.04, "invact-newton": 0.04}.get(fam, 0.12),)
                ax.plot(b, v, style, color=color, label=names[fam], markersize=8 if len(pts) == 1 else 5)
        ax.set_yscale("log")
        ax.set_xlabel("saved bits per element for the backward pass")
        ax.set_ylabel("error of f′ used in backward")
        ax.set_title(title)
        ax.set_xticks(range(1, 9))
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    import textwrap

    fig.suptitle(textwrap.fill(f"{a}: backward-pass derivative error vs memory (Inverted Activations Fig. 5, "
                               "extended)", 100), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig
