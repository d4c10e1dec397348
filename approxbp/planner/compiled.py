"""``torch.compile``'s ``activation_memory_budget`` as one of the planner's moves: an assignment of the
approximations, compiled at a budget b ∈ [0, 1] (inductor's min-cut partitioner recomputes the cheapest ops until
the saved activations are below b of what it would save at 1).

A point is measured on fake tensors as ``approxbp plan`` measures a step (the set-up's model at 2 and 3 blocks,
the assignment on every block), compiled with inductor's partitioner and its forward and backward graphs run op by
op under the fused roofline (``aot_eager_decomp_partition_with_mode``: a recomputed op is charged where it runs,
the elementwise ops between library calls as Inductor's fused kernels); the bytes saved at the end of the forward
and the step's seconds are extrapolated linearly in the blocks (:mod:`approxbp.planner.extrapolate`):

    v(L) = v(3) + (L − 3)·(v(3) − v(2)).

The same assignment run eager is measured the same way, so the compiled step's peak is the planner's measured
peak of the assignment with its eager saved bytes replaced by the compiled ones. The backward's own transient
(what a budget below 1 recomputes at once) is not in it. Every time is a model for the named GPU.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from approxbp.kernels.ops.torch_private import (
    aot_eager_with_mode,
    dynamo_reset,
    lookup_backend,
    patched_functorch_config,
)

__all__ = ["budget_backend", "BUDGETS", "CompiledPoint", "fastest_within", "point", "points", "under"]


#: The budgets the planner weighs (1.0: compile's own choice; 0.0: recompute everything it can).
BUDGETS = (1.0, 0.6, 0.4, 0.2, 0.1, 0.0)


def budget_backend(budget: float, backend="inductor"):
    """A ``torch.compile`` backend that compiles with ``backend`` under ``activation_memory_budget = budget``
    (read when the partitioner runs, at the first call): what :meth:`approxbp.planner.result.Plan.apply` compiles
    a planned model with."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"activation_memory_budget {budget}: expected a fraction in [0, 1]")
    inner = lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_at(gm, example_inputs):
        with patched_functorch_config(activation_memory_budget=budget):
            return inner(gm, example_inputs)

    return compile_at


class _NotAlike(ValueError):
    """The assignment treats the blocks differently: the whole model is measured."""


def _built(request, blocks: tuple[int, int] | None, choice: dict, ms_norm: bool):
    """(model, loss(), the fake scope they live in — entered, to be closed by the caller's ``with``): the request's
    model cut to ``blocks`` = (n, L) blocks of its L (None: whole), built as ``approxbp plan`` builds it, with the
    assignment (its first blocks' options; :class:`_NotAlike` when the blocks' options differ)."""
    from approxbp.planner.extrapolate import layer_count, shrunk, small_assignment
    from approxbp.planner.models import hf_builder, model_spec, no_init
    from approxbp.planner.plan_step import _fake_like_real, apply, seeded, step_inputs
    from approxbp.planner.step_memory import _autocast, _loss_of, first_block, prepare
    from approxbp.planner.training import weights_for

    setup = request.setup
    build = model_spec(request.model, setup.task)
    if blocks is not None:
        count = layer_count(build.config)
        build = hf_builder(shrunk(build.config, count[0], blocks[0]), build.task)
    scope = contextlib.ExitStack()
    scope.enter_context(_fake_like_real())
    scope.enter_context(seeded(0))
    with weights_for(setup), no_init():
        model, make_inputs = build()
        model = prepare(model, setup, request.lora_r)
    inputs = step_inputs(make_inputs, request.batch, request.seq, setup)
    if blocks is not None and choice:
        choice = small_assignment(choice, first_block(model).rpartition(".")[0] + ".", blocks[1])
        if choice is None:
            scope.close()
            raise _NotAlike
    if choice or ms_norm:
        apply(model, choice, ms_norm, inputs)

    def loss():
        with _autocast(setup):
            return _loss_of(model(**inputs))

    return model, loss, scope


@contextlib.contextmanager
def under(mode, loss, budget: float | None):
    """``loss`` to run under ``mode`` (a dispatch mode): eager inside it, or compiled at ``budget`` with its
    partitioned forward and backward graphs run in it (inductor's partitioner, the graphs op by op, so a recomputed
    op reaches the mode where it runs)."""
    if budget is None:
        with mode:
            yield loss
        return
    dynamo_reset()  # a fresh cache: a recompile limit would silently fall back to eager
    yield torch.compile(loss, backend=budget_backend(budget, functools.partial(aot_eager_with_mode, mode=mode)))


class _Modes:
    """Dispatch modes entered as one, the first outermost; reusable, as a compiled step enters its mode once per
    graph run (forward, backward)."""

    def __init__(self, *modes):
        self.modes = modes

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for mode in self.modes:
            self._stack.enter_context(mode)

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def point(request, device, choice: dict, ms_norm: bool, budget: float | None,
          blocks: tuple[int, int] | None = None, watch=None) -> tuple[int, float]:
    """(bytes saved at the end of the forward, roofline seconds of forward and backward) of one step of the
    request's model (cut to n of its L blocks: ``blocks`` = (n, L)) with the assignment: compiled at ``budget``, or
    eager (None). ``watch``: another dispatch mode that sees every op of the same step inside the clock (one
    compile serves both)."""
    from approxbp.kernels.ops.saved import saved_bytes
    from approxbp.planner.step_time import Roofline, drop_in_paths

    model, loss, scope = _built(request, blocks, choice, ms_norm)
    with scope:
        clock = Roofline(device, type(model).__name__, [], [] if budget is not None else drop_in_paths(model),
                         fused=budget is not None)
        out = []
        with under(clock if watch is None else _Modes(clock, watch), loss, budget) as run:
            saved = saved_bytes(lambda: out.append(run()), exclude=list(model.parameters()))
            out[0].backward()
        return saved, clock.time.total


@dataclass(frozen=True)
class CompiledPoint:
    """The assignment compiled at one ``activation_memory_budget``: its modelled peak (bytes), roofline seconds and
    saved bytes."""

    budget: float
    peak: int
    seconds: float
    saved: int


def points(request, device, choice: dict[str, str], ms_norm: bool, eager_peak: int, budgets=BUDGETS,
           say=None) -> list[CompiledPoint]:
    """The assignment compiled at each budget (:class:`CompiledPoint`), with the peak as the module docstring
    writes it from ``eager_peak`` (the planner's measured peak of the assignment). Empty when the model's blocks are
    alike but the assignment's options differ between them: only the whole model could be measured, which takes
    minutes per budget for a 7B model, so such an assignment is weighed eager only."""
    from approxbp.planner.extrapolate import SMALL, layer_count
    from approxbp.planner.models import model_spec

    build = model_spec(request.model, request.setup.task)
    count = layer_count(build.config) if hasattr(build, "config") else None
    depth = count[1] if count and count[1] > SMALL[-1] else None

    def measured(budget):
        if depth is None:
            return point(request, device, choice, ms_norm, budget)
        small = [point(request, device, choice, ms_norm, budget, (n, depth)) for n in SMALL]
        return tuple(b + (depth - SMALL[-1]) * (b - a) for a, b in zip(*small))

    try:
        eager_saved, _ = measured(None)
    except _NotAlike:
        if say:
            say("not compiled: its blocks' options differ (the whole model compiled would take minutes)")
        return []
    out = []
    for budget in budgets:
        if say:
            say(f"compiled at activation_memory_budget {budget}")
        saved, seconds = measured(budget)
        out.append(CompiledPoint(budget, round(eager_peak - eager_saved + saved), seconds, round(saved)))
    return out


def fastest_within(weighed, budget: int, device, request, compile_budgets=(), say=None):
    """(the weighed assignment, what it does) of least modelled seconds within ``budget`` (ties: the least
    gradient-error bound): its recompute / offload moves (:func:`~.plan_moves.fastest`), or the assignment
    compiled at one of ``compile_budgets`` — then :class:`~.plan_parts.Moves` with ``compile`` set and no block
    moves. None when nothing reaches the budget."""
    from approxbp.planner.plan_moves import fastest
    from approxbp.planner.plan_parts import CompileMove, Moves

    best = fastest(weighed, budget, device, request.setup.dtype.itemsize)
    for w in weighed if compile_budgets else ():
        a = w.assignment
        for p in points(request, device, a.choice, a.ms_norm, a.after.peak, compile_budgets, say):
            if p.peak <= budget and (best is None or (p.seconds, a.error) < (best[1].seconds_after,
                                                                             best[0].assignment.error)):
                best = (w, Moves(moves={}, gpu=device.name, gpu_source=device.source, peak=p.peak,
                                 seconds_after=p.seconds, compile=CompileMove(p.budget), saved=p.saved))
    return best
