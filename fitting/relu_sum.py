"""Fitting the ReLU-sum family (Approx-BP §4.2, App. E, App. I) at any bit-width k.

Methods, all seeded and ending in the same deterministic polish:
  anneal  simulated annealing over the knots (the paper's method; scipy.optimize.dual_annealing)
  sgd     Adam on the knots through torch autograd (the paper's alternative)
  polish  L-BFGS-B from a jittered equidistributed start
  auto    anneal for k ≤ 4, polish above (the CLI's and the API's default)
Restarts get independent child seeds (numpy SeedSequence), so results do not depend on --workers. Besides the
method's restarts, every fit polishes the structured starts (:func:`_structured_starts`): the equidistributed
knots, their symmetrisation when h(x) − x/2 is even, the (k−1) solution with a knot inserted in every gap, and
the global optimum on a knot grid by dynamic programming (:mod:`.grid_dp`; exact for the derivative objective,
a separable relaxation for the primitive). Every restart's final loss is recorded, with how many reached the
best, and the table's provenance names the start that found it (``found_by``).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from approxbp.approximations import Activation, get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.relu_sum import check_bits
from scipy.optimize import dual_annealing, minimize

from .grid_dp import GRIDS, grid_dp_knots
from .objective import ReluSumObjective, check_objective, interval_for
from .result import FitResult
from .weights import Weight

__all__ = ["anneal", "auto_method", "cli_command", "equidistributed_knots", "fit_relu_sum", "local_certificate",
           "METHODS", "package_version", "polish", "refine", "ReluSumFit", "Restart", "sgd", "torch_objective"]


METHODS = ("anneal", "sgd", "polish")
#: Relative distance to the best loss within which a restart counts as having reached it.
_SAME_LOSS = 1e-9


def package_version() -> str:
    """The installed approxbp's version (``approxbp.__version__``), recorded in every table's provenance."""
    import approxbp

    return approxbp.__version__


# ---- starting points ----------------------------------------------------------------------------
def equidistributed_knots(obj: ReluSumObjective, rng: np.random.Generator | None = None,
                          jitter: float = 0.0) -> np.ndarray:
    """Knots at quantiles of the asymptotically optimal density ∝ |h''|^p (p = 2/5 for piecewise-linear
    L2 fits of h, 2/3 for piecewise-constant L2 fits of h'), optionally jittered by a seeded rng."""
    grid = np.linspace(obj.A, obj.B, 20001)
    p = 2 / 5 if obj.objective == "primitive" else 2 / 3
    dens = np.abs(obj.activation.d2f(grid)) ** p + 1e-12
    cdf = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2)])
    cdf /= cdf[-1]
    u = (np.arange(obj.n) + 0.5) / obj.n
    if rng is not None and jitter:
        u = np.sort(np.clip(u + rng.uniform(-jitter, jitter, obj.n) / obj.n, 1e-6, 1 - 1e-6))
    return np.interp(u, cdf, grid)


def _is_symmetric(obj: ReluSumObjective) -> bool:
    """h(x) − x/2 even (GELU, SiLU, …): then the optimal knots are symmetric about 0 (for a symmetric interval)."""
    x = np.linspace(0.0, min(-obj.A, obj.B), 401)
    h = obj.activation
    return bool(np.isclose(-obj.A, obj.B) and np.max(np.abs(h.f(x) - h.f(-x) - x)) <= 1e-12 * max(1.0, x[-1]))


def refine(knots: np.ndarray, A: float, B: float) -> np.ndarray:
    """The (k−1) knots with one knot inserted in every gap (2n + 1 knots): midpoints inside, and one
    inner-gap's width beyond each end (clipped to [A, B])."""
    c = np.sort(np.asarray(knots, dtype=np.float64))
    gap = np.diff(c).min() if c.size > 1 else (B - A) / 8
    inner = (c[1:] + c[:-1]) / 2
    ends = np.clip([c[0] - gap / 2, c[-1] + gap / 2], A, B)
    return np.sort(np.concatenate([[ends[0]], c, inner, [ends[1]]]))


def _structured_starts(obj: ReluSumObjective, lower: np.ndarray | None) -> list[tuple[str, np.ndarray]]:
    """Deterministic starts polished in every fit: (label, knots)."""
    eq = equidistributed_knots(obj)
    starts = [("equidistributed", eq)]
    if _is_symmetric(obj):
        starts.append(("symmetric", np.sort((eq - eq[::-1]) / 2)))
    if lower is not None:
        starts.append(("refined k-1", refine(lower, obj.A, obj.B)))
    return starts


#: Up to this k every fit ends with :func:`_relocate` on its best restart.
_RELOCATE_BITS = 4


def _segment_errors(obj: ReluSumObjective, c: np.ndarray) -> np.ndarray:
    """The objective's integrand integrated over each of the n + 1 segments [A, c₁], …, [cₙ, B]."""
    rs = obj.solution(c)
    b = np.concatenate([[obj.A], rs.knots, [obj.B]])
    out = np.empty(b.size - 1)
    for i, (lo, hi) in enumerate(zip(b[:-1], b[1:])):
        x = np.linspace(lo, hi, 65)
        r = obj.target(x) - (rs(x) if obj.objective == "primitive" else rs.derivative(x))
        out[i] = np.trapezoid(r * r, x)
    return out


def _relocate(obj: ReluSumObjective, c: np.ndarray, targets: int = 3, rounds: int = 3) -> np.ndarray:
    """Knot relocation: move each knot in turn to the middle of one of the ``targets`` segments with the largest
    error, polish, keep the best; repeat while it improves. Finds optima that every restart missed, e.g. the
    asymmetric k = 3 optimum of a symmetric activation when the restarts all settle in the symmetric one."""
    best_c, best = np.sort(c), obj(c)[0]
    for _ in range(rounds):
        improved = False
        for j in np.argsort(_segment_errors(obj, best_c))[::-1][:targets]:
            b = np.concatenate([[obj.A], best_c, [obj.B]])
            for i in range(obj.n):
                start = np.sort(np.append(np.delete(best_c, i), (b[j] + b[j + 1]) / 2))
                if np.min(np.diff(start)) <= 1e-9 * (obj.B - obj.A):
                    continue
                cand = polish(obj, start)
                value = obj(cand)[0]
                if value < best * (1 - _SAME_LOSS) and _degenerate(obj, cand) is None:
                    best, best_c, improved = value, cand, True
        if not improved:
            break
    return best_c


# ---- the three methods ---------------------------------------------------------------------------
def _bounds(obj):
    return [(obj.A, obj.B)] * obj.n


def polish(obj: ReluSumObjective, c0: np.ndarray, maxiter: int = 20000, newton_steps: int = 3) -> np.ndarray:
    """L-BFGS-B on J(c) with exact gradients, then guarded Newton steps (Hessian by central differences
    of the exact gradient) that drive |∇J| to rounding level; a step is kept only if J does not rise."""
    res = minimize(obj, c0, jac=True, method="L-BFGS-B", bounds=_bounds(obj),
                   options={"maxiter": maxiter, "maxcor": 50, "ftol": 1e-16, "gtol": 1e-14})
    c = np.sort(res.x)
    for _ in range(newton_steps if obj.n > 1 else 0):
        J0, g = obj(c)
        H = _hessian(obj, c)
        try:
            step = np.linalg.solve(H, g)
        except np.linalg.LinAlgError:
            break
        trial = np.sort(np.clip(c - step, obj.A, obj.B))
        J1, g1 = obj(trial)
        if J1 > J0 * (1 + 1e-13) or np.max(np.abs(g1)) >= np.max(np.abs(g)):
            break
        c = trial
    return c


def _hessian(obj: ReluSumObjective, c: np.ndarray) -> np.ndarray:
    h = 1e-6 * (obj.B - obj.A)
    rows = []
    for e in np.eye(obj.n) * h:  # central differences; one-sided where a knot sits on the interval's end
        hi = c + e if np.all(c + e <= obj.B) else c
        lo = c - e if np.all(c - e >= obj.A) else c
        rows.append((obj(hi)[1] - obj(lo)[1]) / (np.max(hi - lo)))
    H = np.array(rows)
    return (H + H.T) / 2


def anneal(obj: ReluSumObjective, seed: np.random.SeedSequence, maxiter: int | None = None) -> np.ndarray:
    """Simulated annealing over the knots (the paper's method), local steps by L-BFGS-B."""
    rng = np.random.default_rng(seed)
    x0 = equidistributed_knots(obj, rng, jitter=0.8)
    cache: dict = {}

    def value(c):
        key = c.tobytes()
        if key not in cache:
            cache.clear()
            cache[key] = obj(c)
        return cache[key][0]

    def grad(c):
        value(c)
        return cache[c.tobytes()][1]

    res = dual_annealing(value, _bounds(obj), x0=x0, seed=rng,
                         maxiter=maxiter or max(20, 600 // obj.n),
                         minimizer_kwargs={"method": "L-BFGS-B", "jac": grad, "bounds": _bounds(obj)})
    return np.sort(res.x)


def sgd(obj: ReluSumObjective, seed: np.random.SeedSequence, steps: int = 1500, lr: float = 0.05) -> np.ndarray:
    """Adam on the knots with torch autograd through the variable-projected objective
    (quadrature nodes move with the knots; the linear parameters are solved inside the graph)."""
    import torch

    rng = np.random.default_rng(seed)
    c = torch.tensor(equidistributed_knots(obj, rng, jitter=0.8), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([c], lr=lr * (obj.B - obj.A) / (8 * np.sqrt(obj.n)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    loss_fn = torch_objective(obj)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(c).backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            c.clamp_(obj.A, obj.B)
    return np.sort(c.detach().numpy())


def torch_objective(obj: ReluSumObjective, panels: int = 16):
    """J(c) as a differentiable torch function (float64), the same mathematics as ReluSumObjective."""
    import torch

    xi, wi = (torch.tensor(v) for v in np.polynomial.legendre.leggauss(10))
    tau = ((torch.arange(panels, dtype=torch.float64)[:, None] + (xi + 1) / 2) / panels).ravel()
    omega = (wi / (2 * panels)).repeat(panels)
    f, df = obj.activation.torch_fn(0), obj.activation.torch_fn(1)
    target = f if obj.objective == "primitive" else df
    A, B, n = torch.tensor([obj.A], dtype=torch.float64), torch.tensor([obj.B], dtype=torch.float64), obj.n

    def J(c):
        cs = torch.sort(c).values
        b = torch.cat([A, cs, B])
        d = b[1:] - b[:-1]
        x = b[:-1, None] + d[:, None] * tau  # (segments, nodes)
        w = d[:, None] * omega
        t = target(x)
        if obj.objective == "derivative":
            h = f(cs)
            mean = (h[1:] - h[:-1]) / (cs[1:] - cs[:-1])
            mu = (cs[-1] - h[-1] + h[0]) / (cs[-1] - cs[0])
            L = torch.cat([torch.zeros(1, dtype=c.dtype), mean + mu, torch.ones(1, dtype=c.dtype)])
            return (w * (t - L[:, None]) ** 2).sum()
        # primitive: h̃ = Σ_j V_j N_j; V = [0, 0, v_2..v_{n−1}, c_n, B]; solve v by normal equations
        Nl, Nr = 1 - tau, tau
        fixed = torch.zeros(n + 2, dtype=c.dtype)
        fixed = torch.cat([fixed[:n], cs[-1:], B])
        r0 = t - (fixed[:-1, None] * Nl + fixed[1:, None] * Nr)
        m = n - 2
        G = torch.zeros(m, m, dtype=c.dtype)
        rhs = torch.zeros(m, dtype=c.dtype)
        for j in range(m):  # unknown j sits at break j+2: right end of segment j+1, left end of j+2
            G[j, j] = (w[j + 2] * Nl**2).sum() + (w[j + 1] * Nr**2).sum()
            rhs[j] = (w[j + 2] * Nl * r0[j + 2]).sum() + (w[j + 1] * Nr * r0[j + 1]).sum()
            if j + 1 < m:
                G[j, j + 1] = G[j + 1, j] = (w[j + 2] * Nl * Nr).sum()
        V = torch.cat([torch.zeros(2, dtype=c.dtype), torch.linalg.solve(G, rhs), cs[-1:], B])
        approx = V[:-1, None] * Nl + V[1:, None] * Nr
        return (w * (t - approx) ** 2).sum()

    return J


# ---- certification ------------------------------------------------------------------------------
def local_certificate(obj: ReluSumObjective, c: np.ndarray) -> dict:
    """Gradient ∞-norm and the smallest Hessian eigenvalue (central differences of the exact gradient): the fit's
    local optimality check (the rigorous certificates live in :mod:`.certify`)."""
    c = np.sort(c)
    _, g = obj(c)
    out = {"grad_inf_norm": float(np.max(np.abs(g)))}
    if obj.n > 1:
        out["hessian_min_eig"] = float(np.linalg.eigvalsh(_hessian(obj, c))[0])
    out["min_knot_gap"] = float(np.min(np.diff(c))) if obj.n > 1 else None
    return out


# ---- one restart (runs in a worker process) -------------------------------------------------------
@dataclass(frozen=True)
class _Job:
    activation: str
    expression: str
    bits: int
    objective: str
    interval: tuple[float, float]
    weight: Weight | None  # p (fitting/weights.py), or None: uniform
    method: str
    seed: np.random.SeedSequence | None
    restart: int
    start: tuple[float, ...] | None = None  # a structured start (method "start"); (grid points,) for "grid-dp"


class Restart(NamedTuple):
    """One start's outcome: its index, the polished loss and knots, why it is unusable (None: usable), and the
    objective evaluations it took."""

    index: int
    loss: float
    knots: np.ndarray
    degenerate: str | None
    nfev: int


def _run(job: _Job) -> Restart:
    act = Activation.from_expression(job.activation, job.expression)
    obj = ReluSumObjective(act, job.bits, job.objective, job.interval, job.weight)
    if job.method == "start":
        c = np.asarray(job.start)
    elif job.method == "grid-dp":
        c = grid_dp_knots(obj, int(job.start[0]))
    elif job.method == "anneal":
        c = anneal(obj, job.seed)
    elif job.method == "sgd":
        c = sgd(obj, job.seed)
    else:
        c = equidistributed_knots(obj, np.random.default_rng(job.seed), 0.5)
    c = polish(obj, c)
    return Restart(job.restart, obj(c)[0], c, _degenerate(obj, c), obj.nfev)


def _degenerate(obj: ReluSumObjective, c: np.ndarray) -> str | None:
    """Why a polished knot vector is not a usable member of eq. 13 (None when it is): two knots that coincide (their
    weights are not determined). A knot on an end of [A, B] is kept: with a given interval whose tails are heavy
    (squareplus on [−20, 20] at k = 3) the optimum puts the outermost knots there, where eq. 13's constraints are
    met at no cost inside the interval; the table stays a valid member of eq. 13 (h̃ → 0 left, h̃ − x → 0 right)."""
    gap = float(np.min(np.diff(c))) if obj.n > 1 else np.inf
    if gap < 1e-9 * (obj.B - obj.A):
        return f"knots collapsed (gap {gap:.1e})"
    res = obj.solution(c).constraint_residual
    return f"constraint residual {res:.1e}" if res > 1e-12 else None


# ---- the public entry point --------------------------------------------------------------------
class ReluSumFit(FitResult):
    """What :func:`fit_relu_sum` returns (a :class:`~.result.FitResult`): ``table`` (the validated
    :class:`~approxbp.approximations.tables.ReluSumTable`), ``x`` (knots), ``fun`` (loss), ``success``, ``message``,
    ``seconds``, ``nfev`` (objective evaluations over all restarts), ``restarts`` (each restart's final loss, in order),
    ``restart_labels`` and ``at_best`` (how many restarts reached the best loss within a relative 1e-9) and
    ``untrusted`` (only one did, and it was not the grid DP's global optimum of the derivative objective: run more
    restarts). ``success`` is the search's own verdict: a finite loss that is not ``untrusted`` (two restarts agree, or
    the grid DP's global optimum, or the closed form at k = 1)."""


def fit_relu_sum(activation: str = "gelu", bits: int = 2, objective: str = "primitive", method: str = "auto",
                 restarts: int = 4, seed: int = 0, workers: int | None = None, progress: bool = True,
                 command: str | None = None, structured: bool = True,
                 lower_knots: np.ndarray | None = None, interval: tuple[float, float] | None = None,
                 weight: Weight | None = None) -> ReluSumFit:
    """Fit h̃ (eq. 13) to ``activation``: ``restarts`` seeded runs of ``method`` plus the structured starts
    (``structured=False`` leaves those out), each polished; the best one becomes the table. One structured start
    refines the k − 1 solution: ``lower_knots`` (a sweep over k passes the previous fit's ``x``; it must come from
    the default method with the same restarts and seed), else that fit is run first (and k − 2 before it, …).
    ``interval``: [A, B] in place of the tail rule's (:func:`~.objective.interval_for`). On the tail rule's
    interval, an optimum with a knot on its end is refitted on the interval doubled (up to :data:`_WIDENINGS`
    times): a tail that vanishes exactly (hard-swish is 0 and x beyond ±3) gives the narrowest interval, but its
    optimal knots lie outside it (±4.5), and beyond the outermost knot h̃ is 0 or x, so widening changes nothing
    else. ``weight`` (:mod:`.weights`): the objective weighted by the inputs' density p, on its own
    interval (±9σ, a histogram's span; ``interval`` overrides it), never widened."""
    options = dict(method=method, restarts=restarts, seed=seed, workers=workers, progress=progress,
                   command=command, structured=structured, lower_knots=lower_knots, weight=weight)
    fit = _fit(activation, bits, objective, interval=interval, **options)
    (A0, B0), rule = fit.table.interval, fit.table.metrics["interval_rule"]
    for doubled in range(1, 1 + (_WIDENINGS if interval is None and weight is None else 0)):
        (A, B), knots = fit.table.interval, np.asarray(fit.x)
        if not np.any(np.isclose(knots, A, rtol=0, atol=1e-6 * (B - A)) | np.isclose(knots, B, rtol=0,
                                                                                      atol=1e-6 * (B - A))):
            break
        if progress:
            print(f"[fit relu-sum] a knot lay on an end of [{A:g}, {B:g}]: fitting again on [{2 * A:g}, {2 * B:g}]",
                  file=sys.stderr, flush=True)
        fit = _fit(activation, bits, objective, interval=(2 * A, 2 * B), **options)
        why = (f"[{2 * A:g}, {2 * B:g}], the tail rule's [{A0:g}, {B0:g}] doubled {doubled}× because a knot lay "
               f"on an end; the tail rule: {rule}")
        fit.table = fit.table.with_metrics(interval_rule=why)
    return fit


#: How many times :func:`fit_relu_sum` may double the tail rule's interval.
_WIDENINGS = 4


def _fit(activation, bits: int, objective: str, method: str, restarts: int, seed: int, workers, progress: bool,
         command, structured: bool, lower_knots, interval, weight) -> ReluSumFit:
    """:func:`fit_relu_sum` on one interval."""
    t0 = time.perf_counter()
    act = get_activation(activation)
    bits = check_bits(bits)
    check_objective(objective)
    method = _checked(method, bits, restarts, seed)
    act.check_relu_sum_asymptotics(bits)
    A, B, tail, how = interval_for(act, objective, interval, weight)
    obj = ReluSumObjective(act, bits, objective, (A, B), weight)
    if obj.n == 1:  # Σw=1 and Σw·c=0 leave exactly ReLU(x)
        c = np.array([0.0])
        results, labels, nfev, method_used = [Restart(0, obj(c)[0], c, None, 1)], ["closed form"], 1, "closed-form"
    else:
        lower = None
        if structured:
            lower = lower_knots if lower_knots is not None else fit_relu_sum(
                act, bits - 1, objective, restarts=restarts, seed=seed, workers=workers, progress=False,
                interval=interval, weight=weight).x
        results, labels, nfev = _restarts(obj, act, method, restarts, seed, workers, progress, structured, lower)
        method_used = f"{method}+polish"
    best_restart, _, c, _, _ = _best(results)
    degenerate = sum(r.degenerate is not None for r in results)
    rs = obj.solution(c)
    cert = local_certificate(obj, rs.knots)
    loss = obj.loss(rs)
    losses = [float(r.loss) if r.degenerate is None else None for r in results]
    at_best = sum(v is not None and v <= loss * (1 + _SAME_LOSS) + 1e-300 for v in losses)
    table = table_files.ReluSumTable.new(
        act, rs, bits=bits, objective=objective, interval=(A, B), loss=loss,
        metrics={"tail_mass": tail, "interval_rule": how, **({"weight": weight.describe()} if weight else {}),
                 "loss_upper_bound_on_R": loss + tail,
                 "degenerate_restarts": degenerate, "restart_losses": losses,
                 "restart_labels": labels, "restarts_at_best": at_best, **cert},
        provenance={"method": method_used, "seed": seed, "restarts": restarts if obj.n > 1 else 0,
                    "best_restart": best_restart, "found_by": labels[best_restart],
                    "command": command or "approxbp.fitting.fit_relu_sum(...)",
                    "package_version": package_version(), "seconds": round(time.perf_counter() - t0, 3)})
    global_on_grid = labels[best_restart].startswith("grid DP") and objective == "derivative" and weight is None
    untrusted = at_best == 1 and obj.n > 1 and not global_on_grid
    message = (f"{at_best} of {len(results)} restarts reached the best loss {loss:.6e}"
               + ("; only one did: run more restarts to trust this optimum" if untrusted else "")
               + ("; found by the grid DP (the global optimum on its grid, polished)" if global_on_grid else ""))
    return ReluSumFit(table=table, x=rs.knots, fun=loss, success=bool(np.isfinite(loss)) and not untrusted,
                      message=message, nfev=nfev,
                      seconds=table.provenance.get("seconds"),
                      restarts=losses, restart_labels=labels, at_best=at_best, untrusted=untrusted)


def _checked(method: str, bits: int, restarts, seed) -> str:
    """The method (``auto``: :func:`auto_method`), with restarts and seed checked."""
    method = auto_method(bits) if method == "auto" else method
    if method not in METHODS:
        raise ValueError(f"method must be one of {('auto', *METHODS)}, got {method!r}")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 1:
        raise ValueError(f"restarts must be a positive integer, got {restarts!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return method


def _restarts(obj: ReluSumObjective, act, method: str, restarts: int, seed: int, workers, progress: bool,
              structured: bool, lower) -> tuple[list[Restart], list[str], int]:
    """(every restart, its label, function evaluations): ``restarts`` seeded runs of ``method``, the structured
    starts (``lower``: the k − 1 knots) and the grid DPs, each polished in a worker; then, for small k, the best
    one's knots relocated. Refused when every restart degenerated."""
    children = np.random.SeedSequence(seed).spawn(restarts)
    common = (act.name, act.expression, obj.bits, obj.objective, (obj.A, obj.B), obj.weight)
    jobs = [_Job(*common, method, s, i) for i, s in enumerate(children)]
    labels = [f"{method} {i}" for i in range(restarts)]
    for label, start in _structured_starts(obj, lower) if structured else []:
        jobs.append(_Job(*common, "start", None, len(jobs), tuple(start)))
        labels.append(label)
    for points in GRIDS(obj.n) if structured else ():  # computed in workers, beside the restarts
        jobs.append(_Job(*common, "grid-dp", None, len(jobs), (points,)))
        labels.append(f"grid DP {points}")
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    results = _map(jobs, workers, progress, f"{act.name} k={obj.bits} {obj.objective}")
    if all(r.degenerate is not None for r in results):
        raise RuntimeError(f"every restart degenerated ({'; '.join(r.degenerate for r in results)}); "
                           "try more restarts or another method (--restarts N, --method anneal|sgd|polish)")
    nfev = sum(r.nfev for r in results)
    if structured and obj.bits <= _RELOCATE_BITS:
        c = _best(results).knots
        before = obj.nfev
        moved = _relocate(obj, c)
        results.append(Restart(len(results), obj(moved)[0], moved, _degenerate(obj, moved), obj.nfev - before))
        labels.append("relocated best")
        nfev += results[-1].nfev
    return results, labels, nfev


def _best(results: list[Restart]) -> Restart:
    """The usable restart with the lowest loss (the earliest among equals)."""
    return min((r for r in results if r.degenerate is None), key=lambda r: (r.loss, r.index))


def auto_method(bits: int) -> str:
    """Annealing where it is cheap (k ≤ 4); multi-start polish above."""
    return "anneal" if bits <= 4 else "polish"


def _map(jobs, workers, show, label):
    from .progress import progress

    bar = progress(total=len(jobs), desc=label, enabled=show, unit="restart")
    out = []
    if workers <= 1:
        for j in jobs:
            out.append(_run(j))
            bar.update()
    else:
        with ProcessPoolExecutor(workers) as pool:
            for r in pool.map(_run, jobs):
                out.append(r)
                bar.update()
    bar.close()
    return out


def cli_command(argv: list[str]) -> str:
    return "approxbp " + shlex.join(argv)
