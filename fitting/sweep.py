"""Sweeps of ReLU-sum fits over activations × objectives × bit-widths (``approxbp sweep``), each k fit warm-started
from the k − 1 solution of the same activation and objective (its knots are one of the structured starts)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from approxbp.approximations import Activation

from .relu_sum import ReluSumFit, fit_relu_sum

__all__ = ["sweep_relu_sum", "SweepStep"]


#: What a failed fit raises; the sweep reports it and goes on.
_FIT_ERRORS = (ValueError, RuntimeError, ArithmeticError, MemoryError)


@dataclass(frozen=True)
class SweepStep:
    """One fit of a sweep: ``fit`` (None when it failed, with ``error``) and its wall time in seconds."""

    activation: Activation
    objective: str
    bits: int
    fit: ReluSumFit | None
    error: BaseException | None
    seconds: float


def sweep_relu_sum(activations: Iterable[Activation], bits: Iterable[int], objectives: Iterable[str] = ("primitive",),
                   *, restarts: int = 4, seed: int = 0, workers: int | None = None, progress: bool = True,
                   command: str | None = None) -> Iterator[SweepStep]:
    """Fit every (activation, objective, k) in that order and yield each as it is done; the fit for k starts from
    the fit for k − 1 when the sweep made it (``lower_knots``). A fit that fails is yielded with its error and the
    sweep goes on."""
    bits, objectives, done = list(bits), list(objectives), {}
    for a in activations:
        for objective in objectives:
            for k in bits:
                t0 = time.perf_counter()
                try:
                    fit = fit_relu_sum(a, k, objective, restarts=restarts, seed=seed, workers=workers,
                                       progress=progress, command=command,
                                       lower_knots=done.get((a.name, objective, k - 1)))
                except _FIT_ERRORS as err:
                    yield SweepStep(a, objective, k, None, err, time.perf_counter() - t0)
                    continue
                done[(a.name, objective, k)] = fit.x
                yield SweepStep(a, objective, k, fit, None, time.perf_counter() - t0)
