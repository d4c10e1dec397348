"""One planned training step (``approxbp plan``): the options per activation layer, putting an assignment on a
model, the step function that builds a model afresh and measures it (:func:`stepper`, on fake tensors by default;
a model of many alike blocks measured at 2 and 3 and extrapolated) and its roofline timing
(:func:`~.plan_moves.timed`)."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from approxbp.kernels.ops.torch_private import FakeTensorMode
from approxbp.planner.extrapolate import SMALL, extrapolate, layer_count, shrunk, small_assignment
from approxbp.planner.models import hf_builder, model_spec, no_init
from approxbp.planner.moves import RECOMPUTE_PART, apply_moves
from approxbp.planner.request import Request
from approxbp.planner.step_memory import StepMemory, first_block, measure, prepare, weight_shapes
from approxbp.planner.step_time import block_paths
from approxbp.planner.tasks import head_of
from approxbp.planner.training import LoRALinear, Setup, weights_for

__all__ = ["activation_layers", "apply", "gradient_error", "measurer", "layer_options", "option_table",
           "planned_weights", "seeded", "step_inputs", "stepper", "TABLE_OPTION", "table_activation"]


def _approximations() -> dict[str, tuple[type, int]]:
    """Option name → (the family's spec class, bits): every registered family's ``plan_options``, read at each call
    (a family registered later, a user's own, is weighed too; a few specs to walk)."""
    import approxbp.kernels  # noqa: F401  (importing the kernels registers every family's spec)
    from approxbp.kernels.ops.modules import FAMILIES

    return {name: (spec, bits) for spec in FAMILIES.values() for name, bits in spec.plan_options.items()}


def layer_options() -> tuple[str, ...]:
    """Per activation layer: ``exact``, each registered table family's options (named by the family's spec,
    ``Spec.plan_options``; read at each call, so a family registered after import is offered too), and ``glu``: its
    gated MLP becomes the exact fused GLU (saves g and u, recomputes act(g): no gradient error; saves nothing where
    the layer is in no gated MLP)."""
    return ("exact", *_approximations(), "glu")


#: An option that names a table file rather than a family (``--use my-table.json``): ``"table:<path>"``.
TABLE_OPTION = "table:"


@functools.lru_cache(maxsize=64)
def table_activation(path: str) -> str:
    """The activation of a table file (read and validated once: the search asks per layer and per step)."""
    from approxbp.approximations import tables as table_files

    return table_files.load(path).activation


def option_table(activation: str, option: str) -> str | None:
    """The packaged table of an option for a registry activation (None for ``exact`` and ``glu``): the family's own
    ``packaged`` table at the option's bits; a :data:`TABLE_OPTION` names its file (for the table's own activation;
    None for another's: that layer stays exact)."""
    if option in ("exact", "glu"):
        return None
    if option.startswith(TABLE_OPTION):
        path = option[len(TABLE_OPTION):]
        return path if table_activation(path) == activation else None
    spec, bits = _approximations()[option]
    return spec.packaged(activation, bits)


def gradient_error(activation: str, option: str) -> float:
    """E_{x∼N(0,1)}[(h̃′(x) − f′(x))²]^½ for a ReLU-sum table (its levels between its knots, against the exact
    derivative), the certified (else sampled) L∞ of an InvAct table, 0 for exact."""
    from approxbp.approximations import tables as table_files
    from approxbp.approximations.gradient_error import gradient_error as of_table

    table = option_table(activation, option)
    return 0.0 if table is None else of_table(table_files.load(table_files.resolve(table)))


def activation_layers(model: nn.Module) -> dict[str, str]:
    """Module path → registry activation of every activation patch_model can replace."""
    from approxbp.kernels.rewrite.patch import ACTIVATION_CLASSES, class_key

    return {n: ACTIVATION_CLASSES[class_key(m)] for n, m in model.named_modules()
            if class_key(m) in ACTIVATION_CLASSES}


def apply(model: nn.Module, assignment: dict[str, str], ms_norm: bool, inputs: dict | None = None,
          moves: dict[str, str] | None = None, *, chunked_loss: bool = False, parts: tuple[str, ...] = (),
          discovery=None) -> nn.Module:
    """The loss chunked (``chunked_loss``: :func:`~.chunked_loss.apply_chunked_loss`), each layer replaced by its
    option (``exact`` keeps it; ``glu`` fuses its gated MLP) and the norms merged (patch_model's rules), then the
    ``parts`` of every block recomputed alone (a move the planner measures per block) and a plan's ``moves``
    (:func:`~.moves.apply_moves`) — the moves after the rewrites, which patch_model proves on the stock forward.
    Other gated MLPs keep their activation as a layer of its own: the options are per layer. ``discovery``: the
    stepper's :class:`~approxbp.kernels.rewrite.discovery.Discovery` (what patch_model finds, found once)."""
    from approxbp.kernels.rewrite.patch import patch_model
    from approxbp.planner.chunked_loss import apply_chunked_loss

    if chunked_loss:
        apply_chunked_loss(model)
    if assignment or ms_norm:
        layers = activation_layers(model)  # the 2-block model of an extrapolation gets the 3-block assignment
        tables = {path: option_table(act, assignment[path]) or "exact" for path, act in layers.items()
                  if path in assignment}
        fused = {path.rpartition(".")[0] for path, option in assignment.items() if option == "glu" and path in layers}
        patch_model(model, family=None, tables=tables or None, norms=ms_norm, example_input=inputs, check=False,
                    glu=fused, discovery=discovery)
    if parts:
        apply_moves(model, {b: RECOMPUTE_PART + part for b in block_paths(model, first_block(model)) for part in parts})
    return apply_moves(model, moves) if moves else model


def _refuse_float32_grouped_mm(model: nn.Module) -> None:
    """Refuse experts that run transformers' ``grouped_mm`` on weights other than bf16: a GPU's grouped matmul takes
    bf16 only and autocast does not cast it (pytorch#174763), so the step planned would not run there (its fake
    kernel says so with a bare dtype error)."""
    for name, m in model.named_modules():
        weight = getattr(m, "gate_up_proj", None)
        implementation = getattr(getattr(m, "config", None), "_experts_implementation", None)
        if implementation == "grouped_mm" and isinstance(weight, torch.Tensor) and weight.dtype != torch.bfloat16:
            raise ValueError(f"{name}: its experts run grouped_mm on {str(weight.dtype).removeprefix('torch.')} "
                             "weights, which a GPU's grouped matmul does not take (bf16 only; autocast does not cast "
                             "it): plan with bf16 weights (--mode bf16, --mode lora), or add "
                             "experts_implementation=batched_mm to the model's overrides")


def step_inputs(make_inputs, batch: int, seq: int, setup: Setup) -> dict:
    """One step's inputs: the floating ones in the set-up's dtype, unless autocast computes in its own."""
    return {k: v.to(setup.dtype) if torch.is_tensor(v) and v.is_floating_point() and setup.autocast == "off" else v
            for k, v in make_inputs(batch, seq).items()}


def stepper(request: Request, *, whole: bool = False):
    """run(batch, seq, assignment, ms_norm) → the :class:`StepMemory` of one step of the request's model (built
    afresh, on fake tensors unless ``request.fake`` is False) at that batch and sequence length (default: the
    request's) with those replacements; its ``layers`` are the activation layers found before them. The request's
    ``checkpoint``: activation checkpointing; its ``traced`` (default: with checkpointing) a whole step traced by
    :func:`~.step_memory.traced_step` rather than the tensors saved by the forward. A Hugging Face model of more than 3
    alike blocks is measured at 2 and 3 blocks and extrapolated (:mod:`~.extrapolate`) unless ``whole`` or an assignment
    treats its blocks differently."""
    from approxbp.kernels.rewrite.discovery import Discovery

    setup, lora_r, checkpoint, fake = request.setup, request.lora_r, request.checkpoint, request.fake
    traced = checkpoint if request.traced is None else request.traced
    build = model_spec(request.model, setup.task)
    scope = _fake_like_real if fake else contextlib.nullcontext
    count = None if whole or not hasattr(build, "config") else layer_count(build.config)
    small = None
    if count and count[1] > SMALL[-1]:
        small = {n: hf_builder(shrunk(build.config, count[0], n), build.task) for n in SMALL}
    prefix: list[str] = []  # the blocks' path prefix ("model.layers."), known after the first small run
    stock_small: dict[tuple[int, int], StepMemory] = {}  # that run: the stock 3-block step at its sizes
    discovery = Discovery()  # norm readers and gated MLPs found once per kind of model: every step builds it afresh
    head = "{} ({})".format(*head_of(build.config, setup.task)) if hasattr(build, "config") else ""

    def one(builder, batch: int, seq: int, assignment: dict[str, str] | None, ms_norm: bool,
            moves: dict[str, str] | None = None, **extra) -> StepMemory:
        with scope(), seeded(0):
            with weights_for(setup), no_init() if fake else contextlib.nullcontext():
                model, make_inputs = builder()
                model = prepare(model, setup, lora_r, checkpoint)
            _refuse_float32_grouped_mm(model)
            inputs = step_inputs(make_inputs, batch, seq, setup)
            layers = activation_layers(model)
            if assignment or ms_norm or moves or any(extra.values()):
                apply(model, assignment or {}, ms_norm, inputs, moves, discovery=discovery, **extra)
            step = measure(model, inputs, setup, traced)
            step.layers, step.uses_seq = layers, not getattr(make_inputs, "ignores_seq", False)
            step.lora = tuple(sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                                      if isinstance(m, LoRALinear)}))
            step.head = head
            return step

    def run(batch: int | None = None, seq: int | None = None, assignment: dict[str, str] | None = None,
            ms_norm: bool = False, moves: dict[str, str] | None = None, *, chunked_loss: bool = False,
            parts: tuple[str, ...] = ()) -> StepMemory:
        batch, seq = batch or request.batch, seq or request.seq
        extra = {"chunked_loss": chunked_loss, "parts": parts}  # the same in every block: extrapolated as well
        if moves:  # block by block: measured whole
            return one(build, batch, seq, assignment, ms_norm, moves, **extra)
        if small and not prefix:
            stock_small[batch, seq] = one(small[SMALL[-1]], batch, seq, None, False)
            prefix.append(stock_small[batch, seq].block.rpartition(".")[0] + ".")
        part = small_assignment(assignment or {}, prefix[0], count[1]) if small and prefix[0] != "." else None
        if part is None:
            return one(build, batch, seq, assignment, ms_norm, **extra)
        stock = not (part or ms_norm or any(extra.values()))  # the prefix's own run, not measured twice
        two, three = (stock_small[batch, seq] if stock and n == SMALL[-1] and (batch, seq) in stock_small
                      else one(small[n], batch, seq, part, ms_norm, **extra) for n in SMALL)
        return extrapolate(two, three, count[1], prefix[0])

    return run


def planned_weights(request: Request) -> str:
    """:func:`~.result.weight_shapes` of the request's model, built on fake tensors as its steps are (stock: before
    its set-up adds LoRA)."""
    with _fake_like_real(), seeded(0), no_init():
        model, _ = model_spec(request.model, request.setup.task)()
    return weight_shapes(model)


def measurer(request: Request):
    """run(assignment=None, ms_norm=False, *, chunked_loss, parts) → the step at the request's own batch and
    sequence length (:func:`stepper`'s run, which the planner's searches call without sizes)."""
    step = stepper(request)
    return lambda assignment=None, ms_norm=False, **extra: step(None, None, assignment, ms_norm, **extra)


@contextlib.contextmanager
def seeded(seed: int = 0):
    """torch's RNG seeded for a planned model's weights and dropout, and restored after: planning leaves the user's
    random state as it found it (CPU, and every CUDA device already initialised; numpy's and Python's are not
    touched). ``torch.manual_seed`` alone, as the planner once called it, reset the user's dropout stream."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for d in devices:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield


@contextlib.contextmanager
def _fake_like_real():
    """FakeTensorMode, in which Hugging Face models take the path they take on real tensors: transformers treats a
    fake tensor as tracing and skips its check for packed sequences, then materialises a causal mask (kept as an
    input of every checkpointed layer) where a real run of these unpacked inputs uses SDPA's is_causal."""
    from approxbp.planner.compat import unpacked_sequences

    with unpacked_sequences(), FakeTensorMode(allow_non_fake_inputs=True):
        yield
