"""The planner's choice for one request (``approxbp plan``): each activation's options measured
(:func:`measure_options`), then a :class:`Search` over them — the least-error assignment within a budget by a
multiple-choice knapsack (:func:`_choose`), else the assignments weighed with their recompute / offload / chunked-loss
moves (or compiled budgets) on a GPU, the chosen step traced whole and the target tightened where it traced over."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from approxbp.approximations import tables as table_files
from approxbp.kernels.rewrite.discovery import Discovery
from approxbp.planner.gpus import DEFAULT_GPU
from approxbp.planner.gpus import gpu as step_gpu
from approxbp.planner.knapsack import multiple_choice
from approxbp.planner.plan_moves import Assignment, Weighed, move_costs
from approxbp.planner.plan_parts import Moves
from approxbp.planner.plan_step import TABLE_OPTION, gradient_error, layer_options, stepper, table_activation
from approxbp.planner.request import Request
from approxbp.planner.result import OptionCost
from approxbp.planner.step_memory import StepMemory, size, traceable

__all__ = ["distinct", "Measured", "measure_options", "NoFit", "refuse_foreign_table", "Search", "spread", "traces"]


@dataclass(frozen=True)
class Measured:
    """What the search chooses from (:func:`measure_options`): the exact step, its activation layers (module path →
    registry activation), each activation's options with their measured cost, and the MS-norms' saving."""

    base: StepMemory
    layers: dict[str, str]
    options: dict[str, dict[str, OptionCost]]
    ms_saving: int


#: Whole-step traces a budgeted plan may take, and the fraction of the budget below which a tighter target is not
#: sought: a trace over the budget tightens the search's target by the overshoot; a target nothing reaches is halved
#: back toward the last one that was reached.
_TRACES, _RESOLUTION = 8, 0.005


class Search:
    """The choice for one request, over its :class:`Measured` options: the least-error assignment within a budget,
    else the assignments weighed with their moves (or compiled budgets) on ``gpu`` (None: the default GPU), the
    chosen plan traced whole. Holds what the retries under tighter targets share: the candidates weighed once, the
    steps traced by plan."""

    def __init__(self, run, request: Request, measured: Measured, gpu: str | None = None,
                 compile_budgets: tuple[float, ...] = (), say=None):
        self.run, self.request, self.measured = run, request, measured
        self.gpu, self.compile_budgets, self.say = gpu, compile_budgets, say or (lambda msg: None)
        self.device = step_gpu(gpu or DEFAULT_GPU)  # where moves are weighed
        self._weighed: list[Weighed] | None = None
        self._traces: dict[tuple, StepMemory] = {}
        self._tracer = None  # the whole model's stepper, traced (:meth:`traced`)
        self.discovery = Discovery()  # what patch_model finds in the models its moves are timed on, found once

    def traced_within(self, budget: int | None) -> tuple[Assignment, Moves | None, StepMemory | None]:
        """(the assignment, its moves or None, its whole step traced or None) within ``budget``: the chosen step is
        traced whole; over the budget, chosen again under a target tightened by the overshoot (a target nothing
        reaches is halved back toward the last reached), up to :data:`_TRACES` traces."""
        target, traced, over = budget, None, None  # over: the least target whose plan traced over the budget
        for _ in range(_TRACES):
            try:
                picked, moved = self.choose(target)
            except ValueError as err:
                if traced is None:
                    raise
                if over - target > _RESOLUTION * budget:  # the correction overshot what the model reaches: halve it
                    target = (target + over) // 2
                    continue
                raise self._least_traced(budget, f" (the last in {traced.moment}), and nothing reaches a tighter "
                                         f"target ({err})") from None
            traced = self.traced(picked, moved) if budget is not None else None
            if traced is None or traced.peak <= budget:
                return picked, moved, traced
            over = min(target, moved.peak if moved else picked.after.peak)  # what the search believed: tighten
            target = over - (traced.peak - budget)
        raise self._least_traced(budget)

    def choose(self, budget: int | None) -> tuple[Assignment, Moves | None]:
        """(the assignment, its moves or None): the least-error assignment within ``budget``; the moves (or compiled
        budget) of least modelled time only where none reaches it."""
        refused = None
        if not self.compile_budgets:
            try:
                return self.within(budget), None
            except NoFit as err:
                if budget is None:
                    raise
                refused = err
        best, moved = self.fastest(budget, refused or f"nothing planned reaches {size(budget)}")
        return best.assignment, replace(moved, gpu_default=self.gpu is None)  # on DEFAULT_GPU: the report says so

    def within(self, budget: int | None) -> Assignment:
        """The least-error :class:`~.plan_moves.Assignment` within ``budget`` (None: the most saving), measured.
        Savings are measured per option and their sum can be off by what the options share, so the chosen plan is
        measured and the target tightened by what it missed, up to 4 times."""
        m, target = self.measured, budget
        for _ in range(4):
            choice, ms_norm = _choose(m.layers, m.options, m.ms_saving, m.base.peak, target)
            estimate = m.base.peak - sum(m.options[m.layers[p]][o].saving_per_layer for p, o in choice.items()) - (
                m.ms_saving if ms_norm else 0)
            self.say("the chosen plan")
            after = self.run(choice, ms_norm)
            if budget is None or after.peak <= budget:
                error = max((m.options[m.layers[p]][o].error for p, o in choice.items()), default=0.0)
                return Assignment(choice, after, estimate, ms_norm, error)
            target -= after.peak - budget
        raise NoFit(f"no assignment was measured within the budget ({size(after.peak)} > {size(budget)})")

    def assignments(self, count: int = 3) -> list[tuple[int, Assignment]]:
        """(budget, the least-error assignment within it) at ``count`` budgets evenly from the exact peak down to the
        most-saving assignment's peak (the approximations' stretch of the curve; a budget the measured options miss
        is left out): the candidates moves are weighed on."""
        most = self.within(None)
        found = []
        for budget in spread(self.measured.base.peak, most.after.peak, count)[:-1]:
            try:
                found.append((budget, self.within(budget)))
            except NoFit:  # the options' measured savings do not add up to this budget
                continue
        return [*found, (most.after.peak, most)]

    def weighed(self) -> list[Weighed]:
        """Every distinct assignment of :meth:`assignments` with what its moves cost, measured once (a retry under a
        tighter budget weighs the same candidates)."""
        if self._weighed is None:
            self._weighed = [Weighed(a, *move_costs(self.run, self.request, a.choice, a.ms_norm, a.after, self.device,
                                                    self.say, self.discovery)) for a in distinct(self.assignments())]
        return self._weighed

    def fastest(self, budget: int, refused) -> tuple[Weighed, Moves]:
        """The assignment and moves (or compiled budget) of least modelled time within ``budget``: every assignment
        of :meth:`assignments` weighed with its moves, and compiled at each of the compile budgets."""
        from approxbp.planner.compiled import fastest_within

        weighed = self.weighed()
        picked = fastest_within(weighed, budget, self.device, self.request, self.compile_budgets, self.say)
        if picked is None:
            raise ValueError(f"{refused}; and no moves reach it from any of {len(weighed)} assignments weighed "
                             "(recomputing or offloading every block, and the chunked loss where it applies"
                             + (", or compiled at any of the budgets" if self.compile_budgets else "") + ")") from None
        return picked

    def traced(self, picked: Assignment, moved: Moves | None) -> StepMemory | None:
        """The whole step of the chosen plan — its approximations, norms and moves on the model built afresh —
        traced by MemTracker on fake tensors (:func:`~.step_memory.traced_step`: forward, backward, optimizer step,
        each kernel allocating as on a GPU); None where a step cannot be traced (sharded, split over devices, 8-bit
        or paged optimizers, compiled), whose peak stays the model of it. A plan chosen again under a tighter target
        is traced once."""
        if not traces(self.request.setup) or (moved is not None and moved.compile is not None):
            return None
        moves = (moved.moves if moved else None) or None
        chunked = moved is not None and moved.chunks_loss
        key = (tuple(sorted(picked.choice.items())), picked.ms_norm, tuple(sorted((moves or {}).items())), chunked)
        if key not in self._traces:
            self.say("the chosen plan, traced whole")
            if self._tracer is None:  # one stepper for every trace: patch_model's findings found once
                self._tracer = stepper(replace(self.request, traced=True), whole=True)
            self._traces[key] = self._tracer(None, None, picked.choice, picked.ms_norm, moves, chunked_loss=chunked)
        return self._traces[key]

    def _least_traced(self, budget: int, more: str = "") -> NoFit:
        """The refusal when every plan the search chose traced over ``budget``, carrying the least traced peak."""
        peaks = [step.peak for step in self._traces.values()]
        return NoFit(f"no plan fits {size(budget)} in a whole step traced by MemTracker on fake tensors: the "
                     f"{len(peaks)} the search chose peak at {size(min(peaks))} or more{more}",
                     least_traced=min(peaks))


def traces(setup) -> bool:
    """Whether the planner traces this set-up's steps: :func:`~.step_memory.traceable` and not compiled (a compiled
    step's peak stays the modelled one)."""
    return traceable(setup) and not setup.compile


def measure_options(run, say, tables: tuple[str, ...] = ()) -> Measured:
    """The exact step, its activation layers, each activation's options with their saving per layer and gradient
    error, and the MS-norms' saving (:class:`Measured`) — ``run(assignment, ms_norm)`` measures one step. ``tables``:
    a user's table files, each an option (:data:`TABLE_OPTION`) of its own activation beside the packaged ones."""
    say("exact model")
    base = run(None, False)
    layers = base.layers
    for path in tables:  # refused before any option is measured
        refuse_foreign_table("--table", path, layers)
    counts: dict[str, int] = {}
    for act in layers.values():
        counts[act] = counts.get(act, 0) + 1
    options: dict[str, dict[str, OptionCost]] = {}
    for act, n in counts.items():
        options[act] = {"exact": OptionCost(0, 0.0)}
        for option in [*layer_options()[1:], *_table_options(tables, act)]:
            say(f"{act}: {option}")
            every = {p: option for p, a in layers.items() if a == act}
            got = run(every, False)
            options[act][option] = OptionCost((base.peak - got.peak) // n, gradient_error(act, option))
    say("MS-norms")
    merged = run(None, True)
    return Measured(base, layers, options, base.peak - merged.peak)


def _table_options(tables: tuple[str, ...], activation: str) -> list[str]:
    """The :data:`TABLE_OPTION` of each of ``tables`` whose activation is ``activation`` (kernels exported beside it
    where missing)."""
    from approxbp.kernels.codegen import export_if_stale

    found = [str(table_files.resolve(path).resolve()) for path in tables if table_activation(path) == activation]
    for path in found:
        export_if_stale(Path(path))
    return [TABLE_OPTION + path for path in found]


def refuse_foreign_table(flag: str, path: str, layers: dict[str, str]) -> str:
    """The table's activation; refused where none of the model's activation ``layers`` has it."""
    activation = table_activation(path)
    if activation not in layers.values():
        raise ValueError(f"{flag} {path}: a table of {activation!r}; this model's activation layers are "
                         f"{', '.join(sorted(set(layers.values())))}: none would take it")
    return activation


class NoFit(ValueError):
    """No assignment of the approximations reaches the budget (the moves may: ``gpu``). ``least_traced``: where plans
    were traced whole and each peaked over the budget, the least of those peaks (bytes); else None."""

    def __init__(self, message: str, *, least_traced: int | None = None):
        super().__init__(message)
        self.least_traced = least_traced


def distinct(found: list[tuple[int, Assignment]]) -> list[Assignment]:
    """The assignments of :func:`assignments`, each once."""
    out: list[Assignment] = []
    for _, a in found:
        if all((a.choice, a.ms_norm) != (b.choice, b.ms_norm) for b in out):
            out.append(a)
    return out


def spread(high: int, low: int, points: int) -> list[int]:
    """``points`` budgets from ``high`` down to ``low``, evenly spaced."""
    return [round(high - (high - low) * i / (points - 1)) for i in range(points)]


def _choose(layers: dict[str, str], options: dict[str, dict[str, OptionCost]], ms_saving: int, peak: int,
            budget: int | None) -> tuple[dict[str, str], bool]:
    """(the assignment, MS-norms on) of least summed error whose predicted peak is ≤ budget; without a budget the
    one that saves most (least error among those). Multiple-choice knapsack: a DP over saved bytes in units of
    1/4096 of the largest possible saving, one group per activation layer and the MS-norms' group last."""
    groups = [[(o, v.saving_per_layer, v.error) for o, v in options[a].items()] for a in layers.values()]
    groups.append([(False, 0, 0.0), (True, max(ms_saving, 0), 0.0)])

    def chosen(picks: list) -> tuple[dict[str, str], bool]:
        return dict(zip(layers, picks[:-1])), picks[-1]

    if budget is None:
        return chosen([min(opts, key=lambda o: (-o[1], o[2]))[0] for opts in groups])
    need = peak - budget
    if need <= 0:
        return dict.fromkeys(layers, "exact"), False
    top = sum(max(s for _, s, _ in opts) for opts in groups)
    if top < need:
        raise NoFit(f"no assignment fits: the exact step peaks at {size(peak)}, {size(need)} over the budget, "
                         f"and the options save at most {size(top)}")
    found = multiple_choice([[(saving, error) for _, saving, error in opts] for opts in groups], need,
                            max(1, top // 4096))
    if found is None:
        raise NoFit("no assignment fits the budget")
    return chosen([opts[j][0] for opts, j in zip(groups, found[1])])
