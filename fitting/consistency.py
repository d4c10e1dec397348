"""Cross-checks of the committed ReLU-sum tables: a fit that missed its optimum shows up as an outlier.

1. Asymptotic law: with n = 2ᵏ − 1 free knots, the best piecewise-linear L2 error of h falls like n⁻⁴ and the best
   piecewise-constant L2 error of h′ like n⁻², so from k = 4 on each extra bit divides the loss by ≈ 16
   (``primitive``) or ≈ 4 (``derivative``). Allowed: within ±15 % of that.
2. Near-identical activations agree: gelu and gelu_tanh differ by < 5e-4, so their losses agree to 10 % for
   k ≥ 2; quick_gelu(x) = silu(1.702x)/1.702 exactly, so its losses are silu's times 1.702⁻³ (primitive) or
   1.702⁻¹ (derivative), to 1 %.
3. The loss falls with k.
"""

from __future__ import annotations

from collections.abc import Callable

from approxbp.approximations import tables as table_files
from approxbp.approximations.relu_sum import MAX_BITS

__all__ = ["check_consistency"]


_RATIO = {"primitive": 16.0, "derivative": 4.0}
_RATIO_TOL = 0.15
_LAW_FROM_BITS = 4
_QUICK_GELU_SCALE = 1.702


def _losses(load: Callable[[str], table_files.Table | dict], activation: str, objective: str) -> dict[int, float]:
    return {k: table_files.as_table(load(f"relu_sum/{table_files.relu_sum_name(activation, k, objective)}")).loss
            for k in range(1, MAX_BITS + 1)}


def check_consistency(load: Callable[[str], dict] = table_files.load,
                      activations=("gelu", "gelu_tanh", "silu", "quick_gelu", "mish")) -> list[str]:
    """Problems found in the tables (empty when all checks pass); ``load`` maps 'relu_sum/<stem>' to a table."""
    problems = []
    losses = {(a, o): _losses(load, a, o) for a in activations for o in _RATIO}
    for (a, o), ls in losses.items():
        for k in range(1, MAX_BITS):
            if not ls[k + 1] < ls[k]:
                problems.append(f"{a} {o}: loss does not fall from k={k} ({ls[k]:.4e}) to k={k + 1} ({ls[k + 1]:.4e})")
            if k >= _LAW_FROM_BITS:
                r = ls[k] / ls[k + 1]
                if abs(r / _RATIO[o] - 1) > _RATIO_TOL:
                    problems.append(f"{a} {o}: loss ratio k={k}→{k + 1} is {r:.2f}, the asymptotic law says "
                                    f"{_RATIO[o]:g} ± {_RATIO_TOL:.0%}")
    for o in _RATIO:
        if {"gelu", "gelu_tanh"} <= set(activations):
            for k in range(2, MAX_BITS + 1):
                g, gt = losses["gelu", o][k], losses["gelu_tanh", o][k]
                if abs(gt / g - 1) > 0.10:
                    problems.append(f"gelu vs gelu_tanh {o} k={k}: {g:.4e} vs {gt:.4e} differ by {gt / g - 1:+.0%}")
        if {"silu", "quick_gelu"} <= set(activations):
            power = 3 if o == "primitive" else 1
            for k in range(1, MAX_BITS + 1):
                s, q = losses["silu", o][k], losses["quick_gelu", o][k] * _QUICK_GELU_SCALE**power
                if abs(q / s - 1) > 0.01:
                    problems.append(f"silu vs quick_gelu (×1.702^{power}) {o} k={k}: {s:.4e} vs {q:.4e}")
    return problems
