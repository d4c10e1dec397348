"""``approxbp plan``: a training step's memory, measured without the hardware, and a replacement per layer.

One forward of the user's model runs on fake tensors (``FakeTensorMode``: shapes, dtypes and storages, no data),
so a LLaMA-7B config plans in seconds on a laptop. Every tensor autograd saves for backward is caught by
``saved_tensors_hooks`` and charged to the innermost module running when it was saved (module forward hooks keep
the stack), once per storage (a view or a tensor saved twice costs nothing more); parameters are not charged,
they exist anyway. The same code on real tensors gives the measured numbers the tests compare against.

Step memory (Approx-BP Fig. 2's categories): parameters, their gradients and AdamW's two moments (trainable
parameters only, in the parameter dtype as ``torch.optim.AdamW`` keeps them), and the saved activations. The
predicted peak is their sum: at the end of the forward every saved tensor is alive and, unless the previous
step's gradients were freed by ``zero_grad(set_to_none=True)``, so are the gradients (with it the peak is lower
by up to the gradients; transient buffers of single ops are not counted). With activation checkpointing the end
of the forward is not the peak (the backward recomputes each block), so that mode traces a whole step with
PyTorch's ``MemTracker`` instead (:func:`~.step_memory.traced_step`): the peak of what is alive, and its moment.

Per layer, every activation gets the options exact, ReLU-sum k = 1…4 (primitive tables) and InvAct (fast form),
with the saving of the peak measured in this graph (one run per option with every layer of that activation
class replaced, divided by their count: the replacements of different layers never share storages) and the
gradient error of the table, E_{x∼N(0,1)}[(h̃′(x) − f′(x))²]^½ from its knots and levels (ReLU-sum) or its
certified L∞ (InvAct). MS-norm merging is one more option for the whole model. With a budget the assignment
minimising the summed error whose predicted peak fits is chosen (a multiple-choice knapsack by dynamic
programming on the bytes).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from approxbp.approximations import tables as T
from approxbp.planner import chunked_loss
from approxbp.planner.gpus import DEFAULT_GPU
from approxbp.planner.gpus import gpu as step_gpu
from approxbp.planner.knapsack import multiple_choice
from approxbp.planner.plan_moves import Assignment, Weighed, move_costs
from approxbp.planner.plan_step import (
    TABLE_OPTION,
    gradient_error,
    layer_options,
    measurer,
    option_table,
    planned_weights,
    stepper,
    table_activation,
)
from approxbp.planner.request import Request
from approxbp.planner.result import OptionCost, Plan
from approxbp.planner.step_memory import (
    StepMemory,
    size,
    traceable,
)
from approxbp.planner.training import Setup

__all__ = ["assignments", "BROUGHT_BACK", "distinct", "evaluate", "evaluate_each", "KEPT", "MAXIMIZE", "maximize",
           "measure_options", "NoFit", "parse_use", "plan", "spread"]


#: What :func:`maximize` searches for.
MAXIMIZE = ("batch", "seq_len")


def _summary(m: StepMemory) -> dict:
    units = m.block_units
    return {"parameters": m.parameters, "gradients": m.gradients, "optimizer": m.optimizer,
            "activations": m.activations, "peak": m.peak, "activations_by_kind": m.by_kind(),
            "block": m.block, "block_units": None if units is None else round(units, 4), "peak_moment": m.moment,
            "blocks_measured": list(m.blocks_measured), "device_peaks": m.device_peaks() if m.devices > 1 else []}


def plan(request: Request, *, budget: int | None = None, gpu: str | None = None,
         compile_budgets: tuple[float, ...] = (), progress=None) -> Plan:
    """Measure the exact model and each option, then choose (see the module docstring; the request's ``checkpoint``,
    ``traced``: :func:`stepper`'s). ``gpu`` (a name of :data:`~.gpus.GPUS`; None: :data:`~.gpus.DEFAULT_GPU`, and
    the plan says so): where the approximations cannot reach the budget, recompute and offload blocks at the least
    modelled time on it (:mod:`approxbp.planner.plan_moves`).
    ``compile_budgets`` (with ``gpu`` and ``budget``): the fastest plan within the budget of every assignment's
    moves and of every assignment compiled at each of these ``activation_memory_budget`` values
    (:mod:`approxbp.planner.compiled`)."""
    say = progress or (lambda msg: None)
    _one_gpu_budget(request.setup, budget)
    if compile_budgets and (gpu is None or budget is None or not request.fake or request.checkpoint
                            or request.traced):
        raise ValueError("--compile-budgets weighs compiled plans by their modelled time under a budget: it needs "
                         "--gpu and --budget (or --pareto), on fake tensors, without --checkpoint or --trace")
    run = measurer(request)
    if unknown := [t for t in request.tables if not _is_table(t, "--table")]:
        raise ValueError(f"--table {unknown[0]}: not a coefficient table")
    base, layers, options, ms = measure_options(run, say, request.tables)
    target, cache, traces = budget, {}, {}
    traced = over = None  # over: the least target whose plan traced over the budget
    for _ in range(_TRACES):  # the chosen step traced whole; over the budget, chosen again under a tighter target
        try:
            picked, moved = _choose_within(run, request, layers, options, ms, base, target, gpu, compile_budgets,
                                           say, cache)
        except ValueError as err:
            if traced is None:
                raise
            if over - target > _RESOLUTION * budget:  # the correction overshot what the model reaches: halve it
                target = (target + over) // 2
                continue
            raise _least_traced(traces, budget, f" (the last in {traced.moment}), and nothing reaches a tighter "
                                f"target ({err})") from None
        traced = (_traced(request, picked.choice, picked.ms_norm, moved, say, traces) if budget is not None
                  else None)
        if traced is None or traced.peak <= budget:
            break
        over = min(target, moved["peak"] if moved else picked.after.peak)  # what the search believed: tighten below it
        target = over - (traced.peak - budget)
    else:
        raise _least_traced(traces, budget)
    choice, after, estimate, ms = picked.choice, picked.after, picked.estimate, {**ms, "chosen": picked.ms_norm}
    chosen, before = _summary(after), _summary(base)
    chosen = _with_moves(chosen, moved) if moved else chosen
    if traced is not None:  # the promise: the whole step's peak, traced, not the model of it
        chosen = {**chosen, "peak": traced.peak, "peak_moment": traced.moment, "peak_traced": True}
        if not moved and not ms["chosen"] and all(o == "exact" for o in choice.values()):  # the exact step itself
            before = {**before, "peak": traced.peak, "peak_moment": traced.moment, "peak_traced": True}
    return Plan(model=request.model, mode=request.setup.describe(base.lora, base.head), batch=request.batch,
                seq=request.seq if base.uses_seq else None, budget=budget, before=before, after=chosen,
                layers={p: {"activation": layers[p], "option": o, "table": option_table(layers[p], o),
                            **asdict(options[layers[p]][o])} for p, o in choice.items()},
                options=options, ms_norm=ms, estimate=estimate, checkpoint=request.checkpoint,
                shard=request.setup.shard, traced=bool(base.moment), moves=moved,  # only a traced step has a moment
                assignment=_summary(after) if moved else None, weights=planned_weights(request))


#: Whole-step traces a budgeted plan may take, and the fraction of the budget below which a tighter target is not
#: sought: a trace over the budget tightens the search's target by the overshoot; a target nothing reaches is halved
#: back toward the last one that was reached.
_TRACES, _RESOLUTION = 8, 0.005


def _choose_within(run, request, layers, options, ms, base, budget, gpu, compile_budgets, say,
                   cache) -> tuple[Assignment, dict | None]:
    """(the assignment, its moves or None): the least-error assignment within ``budget``; the moves (or compiled
    budget) of least modelled time only where none reaches it."""
    moved = refused = None
    if not compile_budgets:
        try:
            return _within(run, layers, options, ms["saving"], base.peak, budget, say), None
        except NoFit as err:
            if budget is None:
                raise
            refused = err
    best, moved = _fastest(run, request, layers, options, ms, base, budget, gpu or DEFAULT_GPU, compile_budgets,
                           refused or f"nothing planned reaches {size(budget)}", say, cache)
    return best.assignment, {**moved, "gpu_default": gpu is None}  # weighed on DEFAULT_GPU: the report says so


def _traced(request: Request, choice: dict, ms_norm: bool, moved: dict | None, say,
            traces: dict) -> StepMemory | None:
    """The whole step of the chosen plan — its approximations, norms and moves on the model built afresh — traced by
    MemTracker on fake tensors (:func:`~.step_memory.traced_step`: forward, backward, optimizer step, each kernel
    allocating as on a GPU); None where a step cannot be traced (sharded, split over devices, 8-bit or paged
    optimizers, compiled), whose peak stays the model of it. ``traces``: the steps traced so far, by plan (a tighter
    target can choose the same plan again)."""
    if not _traces(request.setup) or (moved or {}).get("compile"):
        return None
    moves = (moved or {}).get("moves") or None
    chunked = chunked_loss.chosen_in(moved)
    key = (tuple(sorted(choice.items())), ms_norm, tuple(sorted((moves or {}).items())), chunked)
    if key not in traces:
        say("the chosen plan, traced whole")
        traces[key] = stepper(replace(request, traced=True), whole=True)(None, None, choice, ms_norm, moves,
                                                                          chunked_loss=chunked)
    return traces[key]


def _traces(setup) -> bool:
    """Whether the planner traces this set-up's steps: :func:`~.step_memory.traceable` and not compiled (a compiled
    step's peak stays the modelled one)."""
    return traceable(setup) and not setup.compile


def _least_traced(traces: dict, budget: int, more: str = "") -> NoFit:
    """The refusal when every plan the search chose traced over ``budget``, carrying the least traced peak."""
    peaks = [step.peak for step in traces.values()]
    return NoFit(f"no plan fits {size(budget)} in a whole step traced by MemTracker on fake tensors: the {len(peaks)} "
                 f"the search chose peak at {size(min(peaks))} or more{more}", least_traced=min(peaks))


#: The final step's activation rows with moves: what the moves keep saved, and what comes back at the peak.
KEPT, BROUGHT_BACK = "kept after the moves", "a moved block or a chunk back at the peak"


def _with_moves(chosen: dict, moved: dict) -> dict:
    """The planned step with its moves: the assignment's (``chosen``) with the moves' saving taken off its
    activations and, for recompute/offload/chunked loss, the largest transient back at the peak — the modelled
    peak of :func:`~.plan_moves.plan_moves` (compiled: the compiled step's saved bytes)."""
    if moved.get("compile"):
        kept, back = moved["saved"], 0
    else:
        kept, back = chosen["activations"] - (chosen["peak"] - moved["end_of_forward"]), moved["transient"]
    return {**chosen, "activations": kept + back, "peak": moved["peak"], "block_units": None,
            "activations_by_kind": {KEPT: kept, **({BROUGHT_BACK: back} if back else {})},
            "device_peaks": [], "peak_moment": None}


def _fastest(run, request: Request, layers, options, ms, base, budget, gpu, compile_budgets, refused,
             say, cache: dict) -> tuple[Weighed, dict]:
    """The assignment and moves (or compiled budget) of least modelled time within ``budget``: every assignment of
    :func:`assignments` weighed with its moves, and compiled at each of ``compile_budgets``."""
    from approxbp.planner.compiled import fastest_within

    device = step_gpu(gpu)
    if "weighed" not in cache:  # a retry under a tighter budget: the candidates and their costs are the same
        cache["weighed"] = [Weighed(a, *move_costs(run, request, a.choice, a.ms_norm, a.after, device, say))
                            for a in distinct(assignments(run, layers, options, ms, base.peak, say))]
    weighed = cache["weighed"]
    picked = fastest_within(weighed, budget, device, request, compile_budgets, say)
    if picked is None:
        raise ValueError(f"{refused}; and no moves reach it from any of {len(weighed)} assignments weighed "
                         "(recomputing or offloading every block, and the chunked loss where it applies"
                         + (", or compiled at any of the budgets" if compile_budgets else "") + ")") from None
    return picked


def measure_options(run, say, tables: tuple[str, ...] = ()
                    ) -> tuple[StepMemory, dict[str, str], dict[str, dict[str, OptionCost]], dict]:
    """(the exact step, its activation layers, each activation's options with their saving per layer and gradient
    error, the MS-norms' saving) — ``run(assignment, ms_norm)`` measures one step. ``tables``: a user's table files,
    each an option (:data:`TABLE_OPTION`) of its own activation beside the packaged ones."""
    say("exact model")
    base = run(None, False)
    layers = base.layers
    for path in tables:  # refused before any option is measured
        _refuse_foreign_table("--table", path, layers)
    counts: dict[str, int] = {}
    for act in layers.values():
        counts[act] = counts.get(act, 0) + 1
    options: dict[str, dict] = {}
    for act, n in counts.items():
        options[act] = {"exact": OptionCost(0, 0.0)}
        for option in [*layer_options()[1:], *_table_options(tables, act)]:
            say(f"{act}: {option}")
            every = {p: option for p, a in layers.items() if a == act}
            got = run(every, False)
            options[act][option] = OptionCost((base.peak - got.peak) // n, gradient_error(act, option))
    say("MS-norms")
    merged = run(None, True)
    return base, layers, options, {"saving": base.peak - merged.peak}


def _table_options(tables: tuple[str, ...], activation: str) -> list[str]:
    """The :data:`TABLE_OPTION` of each of ``tables`` whose activation is ``activation`` (kernels exported beside it
    where missing)."""
    from approxbp.kernels.codegen import export_if_stale

    found = [str(T.resolve(path).resolve()) for path in tables if table_activation(path) == activation]
    for path in found:
        export_if_stale(Path(path))
    return [TABLE_OPTION + path for path in found]


def _refuse_foreign_table(flag: str, path: str, layers: dict[str, str]) -> str:
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


def assignments(run, layers, options, ms: dict, peak: int, say, count: int = 3) -> list[tuple[int, Assignment]]:
    """(budget, the least-error assignment within it) at ``count`` budgets evenly from ``peak`` down to the most-saving
    assignment's peak (the approximations' stretch of the curve; a budget the measured options miss is left out):
    the candidates moves are weighed on."""
    most = _within(run, layers, options, ms["saving"], peak, None, say)
    found = []
    for budget in spread(peak, most.after.peak, count)[:-1]:
        try:
            found.append((budget, _within(run, layers, options, ms["saving"], peak, budget, say)))
        except NoFit:  # the options' measured savings do not add up to this budget
            continue
    return [*found, (most.after.peak, most)]


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


def _within(run, layers, options, ms_saving: int, peak: int, budget: int | None, say) -> Assignment:
    """The least-error :class:`~.plan_moves.Assignment` within ``budget`` (None: the most saving), measured.
    Savings are measured per option and their sum can be off by what the options share, so the chosen plan is
    measured and the target tightened by what it missed, up to 4 times."""
    target = budget
    for _ in range(4):
        choice, ms_norm = _choose(layers, options, ms_saving, peak, target)
        estimate = peak - sum(options[layers[p]][o].saving_per_layer for p, o in choice.items()) - (
            ms_saving if ms_norm else 0)
        say("the chosen plan")
        after = run(choice, ms_norm)
        if budget is None or after.peak <= budget:
            error = max((options[layers[p]][o].error for p, o in choice.items()), default=0.0)
            return Assignment(choice, after, estimate, ms_norm, error)
        target -= after.peak - budget
    raise NoFit(f"no assignment was measured within the budget ({size(after.peak)} > {size(budget)})")


def parse_use(text: str) -> tuple[str | dict[str, str], bool]:
    """``--use``: (one option for every activation layer, or {layer: option} from a plan JSON; MS-norms on/off).
    ``exact``, ``relu-sum-k2``, ``invact``, … (:func:`~.plan_step.layer_options`), or a table file (a user's own
    fit: every layer of its activation takes it, the others stay exact), each optionally ``+ms-norm``; ``ms-norm``
    alone; or the path of a plan written by ``approxbp plan --out``."""
    table, _, rest = text.partition("+")
    if table.endswith(".json") and rest in ("", "ms-norm") and _is_table(table, "--use"):
        return TABLE_OPTION + str(T.resolve(table).resolve()), rest == "ms-norm"
    if text.endswith(".json"):
        from approxbp.planner.result import read_plan

        try:
            data = read_plan(text)
            layers, ms = {p: layer["option"] for p, layer in data["layers"].items()}, data["ms_norm"]["chosen"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"--use {text}: not a plan written by `approxbp plan --out` ({err})") from None
        known = layer_options()
        if bad := sorted({o for o in layers.values() if o not in known and not o.startswith(TABLE_OPTION)}):
            raise ValueError(f"--use {text}: unknown options {bad}; expected {', '.join(known)}")
        return layers, bool(ms)
    parts = text.split("+")
    acts = [p for p in parts if p != "ms-norm"]
    known = layer_options()
    if len(acts) > 1 or any(p not in known for p in acts) or len(parts) != len(set(parts)):
        raise ValueError(f"--use {text!r}: expected one of {', '.join(known)}, optionally +ms-norm (or ms-norm "
                         "alone), or a plan JSON")
    return (acts[0] if acts else "exact"), "ms-norm" in parts


def _is_table(path: str, flag: str) -> bool:
    """Whether ``path`` is a coefficient table (not a plan): its schema and family read (a broken table is
    refused with the table reader's reason)."""
    if not Path(path).is_file():
        return False  # a packaged table is named by its option; a missing file is refused as a plan
    try:
        T.header(path)
    except T.TableError as err:
        if isinstance(data := T.read_json(path), dict) and "layers" in data:
            return False  # a plan
        raise ValueError(f"{flag} {path}: neither a table nor a plan ({err})") from None
    return True


def _table_assignment(use: str, option: str, layers: dict[str, str]) -> dict[str, str]:
    """A table option on the layers of its activation, the others exact (its kernels exported beside it where they
    are missing or stale); refused where no layer has it."""
    from approxbp.kernels.codegen import export_if_stale

    path = option[len(TABLE_OPTION):]
    activation = _refuse_foreign_table("--use", path, layers)
    export_if_stale(Path(path))  # its kernels beside it, as a drop-in of it finds them (said on stderr when written)
    return {p: option if act == activation else "exact" for p, act in layers.items()}


def evaluate(request: Request, *, use: str, budget: int | None = None, progress=None) -> Plan:
    """The exact step (``before``) and the step with the given assignment (``after``, :func:`parse_use`), both
    measured; no option is tried and nothing is chosen. ``budget`` is only recorded (and reported)."""
    return evaluate_each(request, uses=(use,), budget=budget, progress=progress)[0]


def evaluate_each(request: Request, *, uses, budget: int | None = None, progress=None) -> list[Plan]:
    """:func:`evaluate` for each assignment of ``uses``, the exact step measured once for all of them."""
    say = progress or (lambda msg: None)
    parsed = [parse_use(use) for use in uses]
    run = measurer(request)
    say("exact model")
    base = run()
    plans, weights = [], planned_weights(request)
    for use, (option, ms) in zip(uses, parsed):
        if isinstance(option, str) and option.startswith(TABLE_OPTION):
            assignment = _table_assignment(use, option, base.layers)
        else:
            assignment = {p: option for p in base.layers} if isinstance(option, str) else option
        if unknown := sorted(set(assignment) - set(base.layers)):
            raise ValueError(f"--use {use}: the plan names layers this model does not have ({', '.join(unknown[:3])})")
        say(f"the assignment {use}")
        after = run(assignment, ms) if ms or set(assignment.values()) - {"exact"} else base
        layers = {p: {"activation": base.layers[p], "option": o, "table": option_table(base.layers[p], o),
                      "error": gradient_error(base.layers[p], o)} for p, o in assignment.items()}
        plans.append(Plan(model=request.model, mode=request.setup.describe(base.lora, base.head),
                          batch=request.batch, seq=request.seq if base.uses_seq else None, budget=budget,
                          before=_summary(base), after=_summary(after), layers=layers, options={},
                          ms_norm={"chosen": ms, "saving": None}, checkpoint=request.checkpoint,
                          shard=request.setup.shard, traced=bool(base.moment), use=use, weights=weights))
    return plans


#: --maximize seq_len searches multiples of this many tokens.
_SEQ_GRAIN = 64


#: --maximize probes batch sizes and sequence lengths up to this (a larger one is no device's step).
_MAX_PROBE = 1 << 20


def _one_gpu_budget(setup: Setup, budget: int | None) -> None:
    """A budget is one GPU's: refused for a model split over several (``--devices``), whose peaks are reported."""
    if budget is not None and setup.devices > 1:
        raise ValueError("--budget/--maximize plan one GPU's memory; with --devices N the plan reports each GPU's "
                         "peak instead: drop --budget, or plan one GPU (--devices 1)")


def maximize(request: Request, *, what: str, budget: int, use: str | None = None, grain: int = _SEQ_GRAIN,
             progress=None) -> tuple[int, Plan]:
    """The largest ``what`` (``batch`` or ``seq_len``) whose step fits ``budget`` with the most-saving replacements
    (chosen at the request's sizes) or with the assignment ``use`` (:func:`parse_use`; ``exact`` for the stock model),
    by doubling then bisection (sequence lengths in multiples of ``grain`` tokens), one fake step per probe — a
    whole step traced by MemTracker where the set-up can be traced (:func:`~.step_memory.traceable`; else the
    modelled end of the forward), the peak a budget's plan promises; then the least-error plan (or ``use``'s
    evaluation, traced alike) at that size."""
    if what not in ("batch", "seq_len"):
        raise ValueError(f"--maximize {what!r}: expected batch or seq_len")
    _one_gpu_budget(request.setup, budget)
    say = progress or (lambda msg: None)
    batch, seq = request.batch, request.seq
    first = (plan(request, progress=progress) if use is None else evaluate(request, use=use, progress=progress))
    traced = _traces(request.setup)  # the assignment chosen by saved bytes, each probe traced
    if what == "seq_len" and first.seq is None:
        raise ValueError(f"--maximize seq_len: {request.model}'s inputs do not depend on the sequence length")
    step = stepper(replace(request, traced=True) if traced else request)
    assignment = {p: layer["option"] for p, layer in first.layers.items()}

    def fits(v: int) -> bool:
        b, n = (v, seq) if what == "batch" else (batch, v)
        peak = step(b, n, assignment, first.ms_norm["chosen"]).peak
        say(f"{what} = {v}: peak {size(peak)}" + (" (traced)" if traced else ""))
        return peak <= budget

    if not (isinstance(grain, int) and grain >= 1):
        raise ValueError(f"--grain {grain!r}: expected a positive number of tokens")
    grain = 1 if what == "batch" else grain
    lo, hi = 0, max(grain, (batch if what == "batch" else seq) // grain * grain)
    while fits(hi):
        if hi >= _MAX_PROBE:
            raise ValueError(f"--budget {size(budget)} fits {what} = {hi} and beyond: it bounds nothing this planner "
                             f"measures (sizes up to {_MAX_PROBE}); give a device's memory, e.g. 80GiB")
        lo, hi = hi, 2 * hi
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        raise ValueError(f"even {what} = 1 does not fit {size(budget)} with every saving applied")
    at = request.at(batch=lo) if what == "batch" else request.at(seq=lo)
    return lo, (plan(at, budget=budget, progress=progress) if use is None else
                evaluate(replace(at, traced=True) if traced else at, use=use, budget=budget, progress=progress))


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
