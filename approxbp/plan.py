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
PyTorch's ``MemTracker`` instead (:func:`traced_step`): the peak of what is alive, and its moment.

Per layer, every activation gets the options exact, ReLU-sum k = 1…4 (primitive tables) and InvAct (fast form),
with the saving of the peak measured in this graph (one run per option with every layer of that activation
class replaced, divided by their count: the replacements of different layers never share storages) and the
gradient error of the table, E_{x∼N(0,1)}[(h̃′(x) − f′(x))²]^½ from its knots and levels (ReLU-sum) or its
certified L∞ (InvAct). MS-norm merging is one more option for the whole model. With a budget the assignment
minimising the summed error whose predicted peak fits is chosen (a multiple-choice knapsack by dynamic
programming on the bytes).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from approxbp.chunked_loss import CHUNKED, LOSS
from approxbp.extrapolate import SMALL, extrapolate, layer_count, shrunk, small_assignment
from approxbp.gpus import GPUS
from approxbp.gpus import gpu as step_gpu
from approxbp.knapsack import multiple_choice
from approxbp.models import CONFIG_KEYS, CONFIGS, bundled_configs, hf_builder, model_spec, no_init  # noqa: F401
from approxbp.plan_moves import modelled_time, plan_moves, time_step
from approxbp.plan_result import CATEGORIES, COLOURS, Plan, figure, report  # noqa: F401
from approxbp.setup import LORA_TARGETS, LoRALinear, Setup, as_setup, weights_for  # noqa: F401 (0.1's callers)
from approxbp.step_memory import (  # noqa: F401 (read from here by callers of 0.1)
    AT_PEAK,
    StepMemory,
    checkpoint_blocks,
    first_block,
    measure,
    parse_size,
    prepare,
    size,
    traced_step,
)
from approxbp.step_time import block_paths
from approxbp.tasks import head_of

MODES = ("bf16", "autocast", "lora", "compile")  # the presets of approxbp.setup.PRESETS
#: What :func:`maximize` searches for.
MAXIMIZE = ("batch", "seq_len")
#: Per activation layer; ``glu``: its gated MLP becomes the exact fused GLU (saves g and u, recomputes act(g): no
#: gradient error; saves nothing where the layer is in no gated MLP).
OPTIONS = ("exact", "relu-sum-k1", "relu-sum-k2", "relu-sum-k3", "relu-sum-k4", "invact", "glu")


def option_table(activation: str, option: str) -> str | None:
    """The packaged table of an option for a registry activation (None for ``exact`` and ``glu``)."""
    if option in ("exact", "glu"):
        return None
    if option == "invact":
        return f"invact/{activation}-fast"
    from approxbp.approximations import tables as T

    return f"relu_sum/{T.relu_sum_name(activation, int(option[-1]), 'primitive')}"


def gradient_error(activation: str, option: str) -> float:
    """E_{x∼N(0,1)}[(h̃′(x) − f′(x))²]^½ for a ReLU-sum table (its levels between its knots, against the exact
    derivative), the certified (else sampled) L∞ of an InvAct table, 0 for exact."""
    from approxbp.approximations import tables as T
    from approxbp.approximations.gradient_error import gradient_error as of_table

    table = option_table(activation, option)
    return 0.0 if table is None else of_table(T.load(T.resolve(table)))


def activation_layers(model: nn.Module) -> dict[str, str]:
    """Module path → registry activation of every activation patch_model can replace."""
    from approxbp.kernels.patch import ACTIVATION_CLASSES, class_key

    return {n: ACTIVATION_CLASSES[class_key(m)] for n, m in model.named_modules()
            if class_key(m) in ACTIVATION_CLASSES}


def apply(model: nn.Module, assignment: dict[str, str], ms_norm: bool, inputs: dict | None = None) -> nn.Module:
    """Replace each layer by its option (``exact`` keeps it; ``glu`` fuses its gated MLP) and merge the norms
    (patch_model's rules). Other gated MLPs keep their activation as a layer of its own: the options are per layer."""
    from approxbp.chunked_loss import apply_chunked_loss
    from approxbp.kernels.patch import patch_model

    if assignment.get(LOSS) == CHUNKED:
        apply_chunked_loss(model)
        assignment = {p: o for p, o in assignment.items() if p != LOSS}
        if not assignment and not ms_norm:
            return model
    tables = {path: option_table(act, assignment[path]) or "exact"
              for path, act in activation_layers(model).items() if path in assignment}
    fused = {path.rpartition(".")[0] for path, option in assignment.items() if option == "glu"}
    patch_model(model, family=None, tables=tables or None, norms=ms_norm, example_input=inputs, check=False, glu=fused)
    return model


def _summary(m: StepMemory) -> dict:
    units = m.block_units
    return {"parameters": m.parameters, "gradients": m.gradients, "optimizer": m.optimizer,
            "activations": m.activations, "peak": m.peak, "activations_by_kind": m.by_kind(),
            "block": m.block, "block_units": None if units is None else round(units, 4), "peak_moment": m.moment,
            "blocks_measured": list(m.blocks_measured), "device_peaks": m.device_peaks() if m.devices > 1 else []}


def stepper(model_text: str, mode: str | Setup, lora_r: int = 8, fake: bool = True, checkpoint: bool = False,
            traced: bool | None = None, whole: bool = False):
    """run(batch, seq, assignment, ms_norm) → the :class:`StepMemory` of one step of the model (built afresh,
    on fake tensors unless ``fake=False``) with those replacements; its ``layers`` are the activation layers found
    before them. ``checkpoint``: activation checkpointing; ``traced`` (default: with checkpointing) a whole step
    traced by :func:`traced_step` rather than the tensors saved by the forward. A Hugging Face model of more than
    3 alike blocks is measured at 2 and 3 blocks and extrapolated (:mod:`approxbp.extrapolate`) unless ``whole``
    or an assignment treats its blocks differently."""
    setup = as_setup(mode)
    traced = checkpoint if traced is None else traced
    build = model_spec(model_text, setup.task)
    scope = _fake_like_real if fake else contextlib.nullcontext
    count = None if whole or not hasattr(build, "config") else layer_count(build.config)
    small = None
    if count and count[1] > SMALL[-1]:
        small = {n: hf_builder(shrunk(build.config, count[0], n), build.task) for n in SMALL}
    prefix: list[str] = []  # the blocks' path prefix ("model.layers."), known after the first small run
    head = "{} ({})".format(*head_of(build.config, setup.task)) if hasattr(build, "config") else ""

    def one(builder, batch: int, seq: int, assignment: dict[str, str] | None, ms_norm: bool) -> StepMemory:
        with scope():
            torch.manual_seed(0)
            with weights_for(setup), no_init() if fake else contextlib.nullcontext():
                model, make_inputs = builder()
                model = prepare(model, setup, lora_r, checkpoint)
            inputs = make_inputs(batch, seq)
            inputs = {k: v.to(setup.dtype) if torch.is_tensor(v) and v.is_floating_point() and setup.autocast == "off"
                      else v
                      for k, v in inputs.items()}
            layers = activation_layers(model)
            if assignment or ms_norm:
                apply(model, assignment or {}, ms_norm, inputs)
            step = measure(model, inputs, setup, traced)
            step.layers, step.uses_seq = layers, not getattr(make_inputs, "ignores_seq", False)
            step.lora = tuple(sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                                      if isinstance(m, LoRALinear)}))
            step.head = head
            return step

    def run(batch: int, seq: int, assignment: dict[str, str] | None = None, ms_norm: bool = False) -> StepMemory:
        if small and not prefix:
            prefix.append(one(small[SMALL[-1]], batch, seq, None, False).block.rpartition(".")[0] + ".")
        part = small_assignment(assignment or {}, prefix[0], count[1]) if small and prefix[0] != "." else None
        if part is None:
            return one(build, batch, seq, assignment, ms_norm)
        two, three = (one(small[n], batch, seq, part, ms_norm) for n in SMALL)
        return extrapolate(two, three, count[1], prefix[0])

    return run


@contextlib.contextmanager
def _fake_like_real():
    """FakeTensorMode, in which Hugging Face models take the path they take on real tensors: transformers treats a
    fake tensor as tracing and skips its check for packed sequences, then materialises a causal mask (kept as an
    input of every checkpointed layer) where a real run of these unpacked inputs uses SDPA's is_causal."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    with contextlib.ExitStack() as stack:
        try:
            import transformers.masking_utils as masks
        except ImportError:
            masks = None
        if masks is not None and hasattr(masks, "find_packed_sequence_indices"):
            stack.enter_context(mock.patch.object(masks, "find_packed_sequence_indices", lambda position_ids: None))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        yield


def plan(model_text: str, batch: int, seq: int, mode: str | Setup, budget: int | None = None, lora_r: int = 8,
         fake: bool = True, progress=None, checkpoint: bool = False, traced: bool | None = None,
         gpu: str | None = None) -> Plan:
    """Measure the exact model and each option, then choose (see the module docstring; ``checkpoint``, ``traced``:
    :func:`stepper`'s). ``gpu`` (a name of :data:`approxbp.step_time.GPUS`): where the approximations cannot reach
    the budget, recompute and offload blocks at the least modelled time on it (:mod:`approxbp.plan_moves`)."""
    say = progress or (lambda msg: None)
    _one_gpu_budget(mode, budget)
    step = stepper(model_text, mode, lora_r, fake, checkpoint, traced)

    def run(assignment: dict[str, str] | None, ms_norm: bool) -> StepMemory:
        return step(batch, seq, assignment, ms_norm)

    base, layers, options, ms = measure_options(run, say)
    moved = None
    try:
        choice, after, estimate = _within(run, layers, options, ms, base.peak, budget, say)
    except NoFit as refused:
        if budget is None:
            raise
        if gpu is None:
            raise ValueError(f"{refused}; --gpu NAME (one of {', '.join(GPUS)}) adds recompute and offload moves "
                             "to reach it") from None
        choice, after, estimate = _within(run, layers, options, ms, base.peak, None, say)  # the most saving
        device = step_gpu(gpu)
        time, blocks, loss = move_costs(run, model_text, batch, seq, mode, lora_r, choice, ms["chosen"], after,
                                        device, say)
        moved = plan_moves(after, time, blocks, budget, device, as_setup(mode).dtype.itemsize, loss)
    return Plan(model_text, as_setup(mode).describe(base.lora, base.head), batch, seq if base.uses_seq else None,
                budget, _summary(base),
                _summary(after),
                {p: {"activation": layers[p], "option": o, "table": option_table(layers[p], o),
                     **options[layers[p]][o]} for p, o in choice.items()},
                options, ms, estimate, checkpoint, bool(base.moment), moves=moved)  # only a traced step has a moment


def measure_options(run, say) -> tuple[StepMemory, dict[str, str], dict[str, dict], dict]:
    """(the exact step, its activation layers, each activation's options with their saving per layer and gradient
    error, the MS-norms' saving) — ``run(assignment, ms_norm)`` measures one step."""
    say("exact model")
    base = run(None, False)
    layers = base.layers
    counts: dict[str, int] = {}
    for act in layers.values():
        counts[act] = counts.get(act, 0) + 1
    options: dict[str, dict] = {}
    for act, n in counts.items():
        options[act] = {"exact": {"saving_per_layer": 0, "error": 0.0}}
        for option in OPTIONS[1:]:
            say(f"{act}: {option}")
            every = {p: option for p, a in layers.items() if a == act}
            got = run(every, False)
            options[act][option] = {"saving_per_layer": (base.peak - got.peak) // n,
                                    "error": gradient_error(act, option)}
    say("MS-norms")
    merged = run(None, True)
    return base, layers, options, {"saving": base.peak - merged.peak}


def move_costs(run, model_text: str, batch: int, seq: int, mode: str | Setup, lora_r: int,
               choice: dict[str, str], ms_norm: bool, after: StepMemory, device, say):
    """(the step's roofline with the assignment, its block count, the chunked loss's cost or None): what
    :func:`~approxbp.plan_moves.plan_moves` weighs at any budget."""
    say(f"recompute and offload moves, timed for {device.name}")
    time, blocks = timed(model_text, batch, seq, mode, device, lora_r, choice, ms_norm)
    with_loss = {**choice, LOSS: CHUNKED}
    loss = _loss_cost(lambda: run(with_loss, ms_norm),
                      lambda: timed(model_text, batch, seq, mode, device, lora_r, with_loss, ms_norm)[0],
                      after, time, blocks, _loss_sizes(model_text, mode, batch * seq), say)
    return time, blocks, loss


def timed(model_text: str, batch: int, seq: int, mode: str | Setup, device, lora_r: int = 8,
          assignment: dict[str, str] | None = None, ms_norm: bool = False):
    """(the roofline of one step with the assignment, :func:`~approxbp.plan_moves.time_step`; the model's block
    count). A model of more than 3 alike blocks is timed at 3: its block 1 stands for each block, and what is outside
    the blocks does not depend on their number."""
    setup = as_setup(mode)
    build = model_spec(model_text, setup.task)
    count = layer_count(build.config) if hasattr(build, "config") else None
    small = count is not None and count[1] > SMALL[-1]
    if small:
        build = hf_builder(shrunk(build.config, count[0], SMALL[-1]), build.task)
    with _fake_like_real():
        torch.manual_seed(0)
        with weights_for(setup), no_init():
            model, make_inputs = build()
            model = prepare(model, setup, lora_r)
        first = first_block(model)
        if assignment and small and first:
            assignment = small_assignment(assignment, first.rpartition(".")[0] + ".", SMALL[-1])
        if assignment or ms_norm:
            apply(model, assignment or {}, ms_norm, make_inputs(batch, seq))
        blocks = len(block_paths(model, first))
        return time_step(model, make_inputs(batch, seq), setup, device), count[1] if small else blocks


def _loss_cost(measure, time, after: StepMemory, before, blocks: int, sizes: tuple[int, int, int, int] | None, say):
    """The chunked loss as a move (:class:`~approxbp.moves.LossCost`): ``measure()`` and ``time()`` the step with it
    (its saving against ``after``, its modelled seconds against ``before``); its transient one chunk's logits with
    their fp32 softmax and gradient, from ``sizes`` (rows, width, vocabulary, bytes per element). None where the
    model's loss cannot be chunked (said)."""
    from approxbp.chunked_loss import NotChunked, chunk_rows
    from approxbp.moves import LossCost

    if sizes is None:
        say("chunked loss: not applied (not a Hugging Face model)")
        return None
    say("the chunked loss")
    try:
        saving = after.peak - measure().peak
    except NotChunked as why:
        say(f"{why}: not a move here")
        return None
    rows, width, vocab, itemsize = sizes
    transient = chunk_rows(rows, width, vocab) * vocab * (2 * itemsize + 8)
    return LossCost(saving, transient, modelled_time(time(), blocks) - modelled_time(before, blocks))


def _loss_sizes(model_text: str, mode: str | Setup, rows: int) -> tuple[int, int, int, int] | None:
    build = model_spec(model_text, as_setup(mode).task)
    if not hasattr(build, "config"):
        return None
    config = build.config.get_text_config()
    return rows, config.hidden_size, config.vocab_size, as_setup(mode).dtype.itemsize


class NoFit(ValueError):
    """No assignment of the approximations reaches the budget (the moves may: ``gpu``)."""


def _within(run, layers, options, ms: dict, peak: int, budget: int | None, say):
    """(choice, the measured step, the additive estimate) of the least-error assignment within ``budget`` (None:
    the most saving); sets ``ms["chosen"]``. Savings are measured per option and their sum can be off by what the
    options share, so the chosen plan is measured and the target tightened by what it missed, up to 4 times."""
    target = budget
    for _ in range(4):
        choice = _choose(layers, options, ms["saving"], peak, target)
        ms["chosen"] = choice.pop("__ms_norm__") == "on"
        estimate = peak - sum(options[layers[p]][o]["saving_per_layer"] for p, o in choice.items()) - (
            ms["saving"] if ms["chosen"] else 0)
        say("the chosen plan")
        after = run(choice, ms["chosen"])
        if budget is None or after.peak <= budget:
            return choice, after, estimate
        target -= after.peak - budget
    raise NoFit(f"no assignment was measured within the budget ({size(after.peak)} > {size(budget)})")


def parse_use(text: str) -> tuple[str | dict[str, str], bool]:
    """``--use``: (one option for every activation layer, or {layer: option} from a plan JSON; MS-norms on/off).
    ``exact``, ``relu-sum-k2``, ``invact``, … (:data:`OPTIONS`), each optionally ``+ms-norm``; ``ms-norm`` alone;
    or the path of a plan written by ``approxbp plan --out``."""
    if text.endswith(".json"):
        try:
            data = json.loads(Path(text).read_text(encoding="utf-8"))
            layers, ms = {p: layer["option"] for p, layer in data["layers"].items()}, data["ms_norm"]["chosen"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"--use {text}: not a plan written by `approxbp plan --out` ({err})") from None
        if bad := sorted({o for o in layers.values() if o not in OPTIONS}):
            raise ValueError(f"--use {text}: unknown options {bad}; expected {', '.join(OPTIONS)}")
        return layers, bool(ms)
    parts = text.split("+")
    acts = [p for p in parts if p != "ms-norm"]
    if len(acts) > 1 or any(p not in OPTIONS for p in acts) or len(parts) != len(set(parts)):
        raise ValueError(f"--use {text!r}: expected one of {', '.join(OPTIONS)}, optionally +ms-norm (or ms-norm "
                         "alone), or a plan JSON")
    return (acts[0] if acts else "exact"), "ms-norm" in parts


def evaluate(model_text: str, batch: int, seq: int, mode: str | Setup, use: str, lora_r: int = 8, fake: bool = True,
             progress=None, checkpoint: bool = False, traced: bool | None = None, budget: int | None = None) -> Plan:
    """The exact step (``before``) and the step with the given assignment (``after``, :func:`parse_use`), both
    measured; no option is tried and nothing is chosen. ``budget`` is only recorded (and reported)."""
    return evaluate_each(model_text, batch, seq, mode, (use,), lora_r, fake, progress, checkpoint, traced, budget)[0]


def evaluate_each(model_text: str, batch: int, seq: int, mode: str | Setup, uses, lora_r: int = 8, fake: bool = True,
                  progress=None, checkpoint: bool = False, traced: bool | None = None,
                  budget: int | None = None) -> list[Plan]:
    """:func:`evaluate` for each assignment of ``uses``, the exact step measured once for all of them."""
    say = progress or (lambda msg: None)
    parsed = [parse_use(use) for use in uses]
    step = stepper(model_text, mode, lora_r, fake, checkpoint, traced)
    say("exact model")
    base = step(batch, seq)
    plans = []
    for use, (option, ms) in zip(uses, parsed):
        assignment = {p: option for p in base.layers} if isinstance(option, str) else option
        if unknown := sorted(set(assignment) - set(base.layers)):
            raise ValueError(f"--use {use}: the plan names layers this model does not have ({', '.join(unknown[:3])})")
        say(f"the assignment {use}")
        after = step(batch, seq, assignment, ms) if ms or set(assignment.values()) - {"exact"} else base
        layers = {p: {"activation": base.layers[p], "option": o, "table": option_table(base.layers[p], o),
                      "error": gradient_error(base.layers[p], o)} for p, o in assignment.items()}
        plans.append(Plan(model_text, as_setup(mode).describe(base.lora, base.head), batch,
                          seq if base.uses_seq else None, budget,
                          _summary(base), _summary(after), layers, {}, {"chosen": ms, "saving": None}, None, checkpoint,
                          bool(base.moment), use))
    return plans


#: --maximize seq_len searches multiples of this many tokens.
SEQ_GRAIN = 64


#: --maximize probes batch sizes and sequence lengths up to this (a larger one is no device's step).
MAX_PROBE = 1 << 20


def _one_gpu_budget(mode: str | Setup, budget: int | None) -> None:
    """A budget is one GPU's: refused for a model split over several (``--devices``), whose peaks are reported."""
    if budget is not None and as_setup(mode).devices > 1:
        raise ValueError("--budget/--maximize plan one GPU's memory; with --devices N the plan reports each GPU's "
                         "peak instead: drop --budget, or plan one GPU (--devices 1)")


def maximize(model_text: str, what: str, batch: int, seq: int, mode: str | Setup, budget: int, lora_r: int = 8,
             progress=None, checkpoint: bool = False, traced: bool | None = None,
             use: str | None = None, grain: int = SEQ_GRAIN) -> tuple[int, Plan]:
    """The largest ``what`` (``batch`` or ``seq_len``) whose step fits ``budget`` with the most-saving replacements
    (chosen at the given sizes) or with the assignment ``use`` (:func:`parse_use`; ``exact`` for the stock model),
    by doubling then bisection (sequence lengths in multiples of ``grain`` tokens), one fake step per probe; then
    the least-error plan (or ``use``'s evaluation) at that size."""
    if what not in ("batch", "seq_len"):
        raise ValueError(f"--maximize {what!r}: expected batch or seq_len")
    _one_gpu_budget(mode, budget)
    say = progress or (lambda msg: None)
    kwargs = dict(progress=progress, checkpoint=checkpoint, traced=traced)
    first = (plan(model_text, batch, seq, mode, None, lora_r, **kwargs) if use is None else
             evaluate(model_text, batch, seq, mode, use, lora_r, **kwargs))
    if what == "seq_len" and first.seq is None:
        raise ValueError(f"--maximize seq_len: {model_text}'s inputs do not depend on the sequence length")
    step = stepper(model_text, mode, lora_r, checkpoint=checkpoint, traced=traced)
    assignment = {p: layer["option"] for p, layer in first.layers.items()}

    def fits(v: int) -> bool:
        b, n = (v, seq) if what == "batch" else (batch, v)
        peak = step(b, n, assignment, first.ms_norm["chosen"]).peak
        say(f"{what} = {v}: peak {size(peak)}")
        return peak <= budget

    if not (isinstance(grain, int) and grain >= 1):
        raise ValueError(f"--grain {grain!r}: expected a positive number of tokens")
    grain = 1 if what == "batch" else grain
    lo, hi = 0, max(grain, (batch if what == "batch" else seq) // grain * grain)
    while fits(hi):
        if hi >= MAX_PROBE:
            raise ValueError(f"--budget {size(budget)} fits {what} = {hi} and beyond: it bounds nothing this planner "
                             f"measures (sizes up to {MAX_PROBE}); give a device's memory, e.g. 80GiB")
        lo, hi = hi, 2 * hi
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        raise ValueError(f"even {what} = 1 does not fit {size(budget)} with every saving applied")
    b, n = (lo, seq) if what == "batch" else (batch, lo)
    return lo, (plan(model_text, b, n, mode, budget, lora_r, **kwargs) if use is None else
                evaluate(model_text, b, n, mode, use, lora_r, budget=budget, **kwargs))


def _choose(layers: dict[str, str], options: dict[str, dict], ms_saving: int, peak: int,
            budget: int | None) -> dict[str, str]:
    """The assignment (with "__ms_norm__": on/off) of least summed error whose predicted peak is ≤ budget; without a
    budget the one that saves most (least error among those). Multiple-choice knapsack: a DP over saved bytes in
    units of 1/4096 of the largest possible saving."""
    groups = [(p, [(o, v["saving_per_layer"], v["error"]) for o, v in options[a].items()]) for p, a in layers.items()]
    groups.append(("__ms_norm__", [("off", 0, 0.0), ("on", max(ms_saving, 0), 0.0)]))
    if budget is None:
        return {p: min(opts, key=lambda o: (-o[1], o[2]))[0] for p, opts in groups}
    need = peak - budget
    if need <= 0:
        return {p: "exact" if p != "__ms_norm__" else "off" for p, _ in groups}
    top = sum(max(s for _, s, _ in opts) for _, opts in groups)
    if top < need:
        raise NoFit(f"no assignment fits: the exact step peaks at {size(peak)}, {size(need)} over the budget, "
                         f"and the options save at most {size(top)}")
    found = multiple_choice([[(saving, error) for _, saving, error in opts] for _, opts in groups], need,
                            max(1, top // 4096))
    if found is None:
        raise NoFit("no assignment fits the budget")
    return {path: opts[j][0] for (path, opts), j in zip(groups, found[1])}
