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

from approxbp.approximations import tables as table_files
from approxbp.planner.plan_moves import Assignment
from approxbp.planner.plan_parts import Moves, MsNorm, PlannedLayer, StepSummary
from approxbp.planner.plan_step import (
    TABLE_OPTION,
    gradient_error,
    layer_options,
    measurer,
    option_table,
    planned_weights,
    stepper,
)
from approxbp.planner.request import Request
from approxbp.planner.result import Plan
from approxbp.planner.search import Measured, NoFit, Search, measure_options, refuse_foreign_table, traces
from approxbp.planner.step_memory import (
    StepMemory,
    size,
)
from approxbp.planner.training import Setup

__all__ = ["BROUGHT_BACK", "evaluate", "evaluate_each", "KEPT", "MAXIMIZE", "maximize", "NoFit", "parse_use", "plan"]


#: What :func:`maximize` searches for.
MAXIMIZE = ("batch", "seq_len")


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
    search = Search(run, request, measure_options(run, say, request.tables), gpu, compile_budgets, say)
    picked, moved, traced = search.traced_within(budget)
    return _plan_of(request, search.measured, picked, moved, traced, budget)


def _plan_of(request: Request, measured: Measured, picked: Assignment, moved: Moves | None,
             traced: StepMemory | None, budget: int | None) -> Plan:
    """The plan of the chosen assignment and moves: ``after`` the planned step (its moves' modelled peak, else the
    measured one; a traced step's peak where one was traced: the promise), ``before`` the exact step."""
    base, layers, options = measured.base, measured.layers, measured.options
    approximated, before = StepSummary.of(picked.after), StepSummary.of(base)
    chosen = _with_moves(approximated, moved) if moved else approximated
    if traced is not None:  # the promise: the whole step's peak, traced, not the model of it
        chosen = replace(chosen, peak=traced.peak, peak_moment=traced.moment, peak_traced=True)
        if not moved and not picked.ms_norm and all(o == "exact" for o in picked.choice.values()):  # exact itself
            before = replace(before, peak=traced.peak, peak_moment=traced.moment, peak_traced=True)
    return Plan(model=request.model, mode=request.setup.describe(base.lora, base.head), batch=request.batch,
                seq=request.seq if base.uses_seq else None, budget=budget, before=before, after=chosen,
                layers={p: PlannedLayer(layers[p], o, option_table(layers[p], o), **asdict(options[layers[p]][o]))
                        for p, o in picked.choice.items()},
                options=options, ms_norm=MsNorm(measured.ms_saving, picked.ms_norm), estimate=picked.estimate,
                checkpoint=request.checkpoint, shard=request.setup.shard, traced=bool(base.moment),  # a traced step
                moves=moved, assignment=approximated if moved else None,  # has a moment
                weights=planned_weights(request))


#: The final step's activation rows with moves: what the moves keep saved, and what comes back at the peak.
KEPT, BROUGHT_BACK = "kept after the moves", "a moved block or a chunk back at the peak"


def _with_moves(chosen: StepSummary, moved: Moves) -> StepSummary:
    """The planned step with its moves: the assignment's (``chosen``) with the moves' saving taken off its
    activations and, for recompute/offload/chunked loss, the largest transient back at the peak — the modelled
    peak of :func:`~.plan_moves.plan_moves` (compiled: the compiled step's saved bytes)."""
    if moved.compile is not None:
        kept, back = moved.saved, 0
    else:
        kept, back = chosen.activations - (chosen.peak - moved.end_of_forward), moved.transient
    return replace(chosen, activations=kept + back, peak=moved.peak, block_units=None,
                   activations_by_kind={KEPT: kept, **({BROUGHT_BACK: back} if back else {})}, device_peaks=(),
                   peak_moment=None)


def parse_use(text: str) -> tuple[str | dict[str, str], bool]:
    """``--use``: (one option for every activation layer, or {layer: option} from a plan JSON; MS-norms on/off).
    ``exact``, ``relu-sum-k2``, ``invact``, … (:func:`~.plan_step.layer_options`), or a table file (a user's own
    fit: every layer of its activation takes it, the others stay exact), each optionally ``+ms-norm``; ``ms-norm``
    alone; or the path of a plan written by ``approxbp plan --out``."""
    table, _, rest = text.partition("+")
    if table.endswith(".json") and rest in ("", "ms-norm") and _is_table(table, "--use"):
        return TABLE_OPTION + str(table_files.resolve(table).resolve()), rest == "ms-norm"
    if text.endswith(".json"):
        from approxbp.planner.result import planned_layers

        try:
            planned, ms_norm = planned_layers(text)
            layers, ms = {p: layer.option for p, layer in planned.items()}, ms_norm.chosen
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
        table_files.header(path)
    except table_files.TableError as err:
        if isinstance(data := table_files.read_json(path), dict) and "layers" in data:
            return False  # a plan
        raise ValueError(f"{flag} {path}: neither a table nor a plan ({err})") from None
    return True


def _table_assignment(use: str, option: str, layers: dict[str, str]) -> dict[str, str]:
    """A table option on the layers of its activation, the others exact (its kernels exported beside it where they
    are missing or stale); refused where no layer has it."""
    from approxbp.kernels.codegen import export_if_stale

    path = option[len(TABLE_OPTION):]
    activation = refuse_foreign_table("--use", path, layers)
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
        layers = {p: PlannedLayer(base.layers[p], o, option_table(base.layers[p], o),
                                  error=gradient_error(base.layers[p], o)) for p, o in assignment.items()}
        plans.append(Plan(model=request.model, mode=request.setup.describe(base.lora, base.head),
                          batch=request.batch, seq=request.seq if base.uses_seq else None, budget=budget,
                          before=StepSummary.of(base), after=StepSummary.of(after), layers=layers, options={},
                          ms_norm=MsNorm(None, ms), checkpoint=request.checkpoint,
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
    by a safeguarded secant search (:func:`_largest_fitting`; sequence lengths in multiples of ``grain`` tokens), one
    fake step per probe — a whole step traced by MemTracker where the set-up can be traced
    (:func:`~.step_memory.traceable`; else the modelled end of the forward), the peak a budget's plan promises; then
    the least-error plan (or ``use``'s evaluation, traced alike) at that size."""
    if what not in ("batch", "seq_len"):
        raise ValueError(f"--maximize {what!r}: expected batch or seq_len")
    _one_gpu_budget(request.setup, budget)
    say = progress or (lambda msg: None)
    batch, seq = request.batch, request.seq
    first = (plan(request, progress=progress) if use is None else evaluate(request, use=use, progress=progress))
    traced = traces(request.setup)  # the assignment chosen by saved bytes, each probe traced
    if what == "seq_len" and first.seq is None:
        raise ValueError(f"--maximize seq_len: {request.model}'s inputs do not depend on the sequence length")
    step = stepper(replace(request, traced=True) if traced else request)
    assignment = {p: layer.option for p, layer in first.layers.items()}

    def peak_at(v: int) -> int:
        b, n = (v, seq) if what == "batch" else (batch, v)
        peak = step(b, n, assignment, first.ms_norm.chosen).peak
        say(f"{what} = {v}: peak {size(peak)}" + (" (traced)" if traced else ""))
        return peak

    if not (isinstance(grain, int) and grain >= 1):
        raise ValueError(f"--grain {grain!r}: expected a positive number of tokens")
    grain = 1 if what == "batch" else grain
    lo = _largest_fitting(peak_at, batch if what == "batch" else seq, grain, budget, what)
    if lo == 0:
        raise ValueError(f"even {what} = 1 does not fit {size(budget)} with every saving applied")
    at = request.at(batch=lo) if what == "batch" else request.at(seq=lo)
    return lo, (plan(at, budget=budget, progress=progress) if use is None else
                evaluate(replace(at, traced=True) if traced else at, use=use, budget=budget, progress=progress))


def _largest_fitting(peak_at, start: int, grain: int, budget: int, what: str) -> int:
    """The largest multiple v of ``grain`` with ``peak_at(v) ≤ budget`` (0 where ``grain`` itself does not fit), for
    a peak nondecreasing in v — what doubling then bisection finds, in fewer probes: the peak is close to affine in
    the batch (convex in the sequence length), so the line through the bracket's two ends (or the two largest
    fitting probes, before one fails) predicts the answer. Each probe is that prediction moved strictly inside the
    bracket (the largest fitting, the least failing probe); doubling while only one probe is known or the line is
    flat; bisection after a probe that did not halve the bracket. The answer is the bracket's lower end once its
    ends are one grain apart (an affine peak: at most 5 probes, where doubling then bisection takes about twice
    log₂ of the answer; tests/approxbp/planner/test_plan.py checks both)."""
    peaks: dict[int, int] = {}
    lo, hi, halve, v = 0, None, False, max(grain, start // grain * grain)
    while True:
        width = None if hi is None else hi - lo
        peaks[v] = peak_at(v)
        if peaks[v] <= budget:
            if v >= _MAX_PROBE:
                raise ValueError(f"--budget {size(budget)} fits {what} = {v} and beyond: it bounds nothing this "
                                 f"planner measures (sizes up to {_MAX_PROBE}); give a device's memory, e.g. 80GiB")
            lo = v
        else:
            hi = v
        if hi is not None and hi - lo <= grain:
            return lo
        halve = not halve and width is not None and 2 * (hi - lo) > width  # the line crawled: bisect once
        v = _next_probe(peaks, lo, hi, grain, budget, halve)


def _next_probe(peaks: dict[int, int], lo: int, hi: int | None, grain: int, budget: int, halve: bool) -> int:
    """:func:`_largest_fitting`'s next probe, a multiple of ``grain`` strictly between ``lo`` and ``hi``: on the line
    through the bracket's ends, or through the two probes nearest its one known side."""
    fitting, failing = sorted(v for v in peaks if v <= lo), sorted(v for v in peaks if hi is not None and v >= hi)
    line = ((lo, hi) if lo and hi is not None else tuple(fitting[-2:]) if hi is None else tuple(failing[:2]))
    guess = None
    if len(line) == 2 and not halve and peaks[line[1]] != peaks[line[0]]:
        (a, b), (pa, pb) = line, (peaks[line[0]], peaks[line[1]])
        guess = int((a + (budget - pa) * (b - a) / (pb - pa)) // grain * grain)
    if hi is None:
        return min(max(2 * lo if guess is None else guess, lo + grain), _MAX_PROBE)
    return min(max((lo + hi) // 2 // grain * grain if guess is None else guess, lo + grain), hi - grain)
