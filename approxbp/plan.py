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
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from approxbp.attention import gpu_attention
from approxbp.extrapolate import SMALL, extrapolate, layer_count, shrunk, small_assignment
from approxbp.kernels.saved import charged
from approxbp.setup import (  # noqa: F401 (LORA_TARGETS, LoRALinear: read from here by callers of 0.1)
    DTYPES,
    LORA_TARGETS,
    LoRALinear,
    Setup,
    add_lora,
    as_setup,
    norms_in_fp32,
    optimizer_bytes,
    per_rank,
    quantize_base,
    quantized_weights,
    stored_bytes,
    weights_for,
)
from approxbp.tasks import build as build_task
from approxbp.tasks import task_of

MODES = ("bf16", "autocast", "lora", "compile")  # the presets of approxbp.setup.PRESETS
#: Per activation layer; ``glu``: its gated MLP becomes the exact fused GLU (saves g and u, recomputes act(g): no
#: gradient error; saves nothing where the layer is in no gated MLP).
OPTIONS = ("exact", "relu-sum-k1", "relu-sum-k2", "relu-sum-k3", "relu-sum-k4", "invact", "glu")
#: Short keys of ``llama:hidden=4096,layers=32,…`` → Hugging Face config fields.
CONFIG_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "intermediate": "intermediate_size", "vocab": "vocab_size", "kv_heads": "num_key_value_heads",
               "image": "image_size", "patch": "patch_size"}


@dataclass
class StepMemory:
    """Bytes of one training step (see the module docstring)."""

    parameters: int
    gradients: int
    optimizer: int
    saved: dict[str, int] = field(default_factory=dict)  # module path → saved bytes charged to it
    kinds: dict[str, str] = field(default_factory=dict)  # module path → its class name
    block: str = ""  # the first of the model's repeated blocks (a ModuleList's entry 0); "": the model itself
    block_input: int = 0  # elements of that block's input hidden state, b·n·c (0: its hook did not fire)
    layers: dict[str, str] = field(default_factory=dict)  # the activation layers found before any replacement
    moment: str = ""  # a traced step's peak: "backward of model.layers.3"; "": the end of the forward
    uses_seq: bool = True  # False: the model's inputs do not depend on --seq (an image model)
    blocks_measured: tuple[int, ...] = ()  # (2, 3): extrapolated from models of that many blocks; (): measured whole

    @property
    def block_units(self) -> float | None:
        """The first block's saved bytes in units of a 16-bit [b, n, c] tensor (Approx-BP App. B, Figs. 5–6)."""
        if not self.block_input:  # a compiled model's hooks do not fire
            return None
        mine = sum(b for path, b in self.saved.items()
                   if not self.block or path == self.block or path.startswith(self.block + "."))
        return mine / (2 * self.block_input)

    @property
    def activations(self) -> int:
        return sum(self.saved.values())

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def by_kind(self) -> dict[str, int]:
        """Saved bytes by category of the saving module: activation, norm, linear, attention, other."""
        out: dict[str, int] = {}
        for path, b in self.saved.items():
            kind = _category(self.kinds.get(path, ""))
            out[kind] = out.get(kind, 0) + b
        return out


def size(b: float) -> str:
    """Bytes in binary units: 1.50 GiB, 12.0 MiB, 640 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"


def parse_size(text: str) -> int:
    """'24GiB', '512 MiB', '1e9' → bytes."""
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m[2].lower() not in units:
        raise ValueError(f"size {text!r}: expected a number and one of GiB, MiB, KiB, GB, MB, kB or B")
    return int(float(m[1]) * units[m[2].lower()])


def _category(kind: str) -> str:
    from approxbp.kernels.patch import ACTIVATION_CLASSES, OURS

    low = kind.lower()
    if kind in ACTIVATION_CLASSES or kind in OURS or "activation" in low or kind in ("GELU", "SiLU", "Mish"):
        return "activation functions"
    if "norm" in low:
        return "norms"
    if "linear" in low or "conv" in low or "embedding" in low:
        return "linear / embedding inputs"
    if "attention" in low or "sdpa" in low:
        return "attention"
    if "mlp" in low:
        return "MLP products (SwiGLU)"
    return "other"


def _loss_of(out) -> torch.Tensor:
    for v in (out.values() if isinstance(out, dict) else [getattr(out, "logits", None), out]):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.float().mean()
    if hasattr(out, "to_tuple"):
        return _loss_of(out.to_tuple())
    if isinstance(out, tuple | list):
        return _loss_of(out[0])
    raise TypeError(f"cannot find a floating output to make a loss of: {type(out).__name__}")


def _autocast(setup: Setup):
    return torch.autocast("cpu", dtype=DTYPES.get(setup.autocast, torch.bfloat16), enabled=setup.autocast != "off")


def measure(model: nn.Module, inputs: dict, mode: str | Setup, traced: bool = False) -> StepMemory:
    """One training step's memory (forward with the saved-tensor hooks; the backward is not needed for what is
    saved). The set-up (:class:`~approxbp.setup.Setup` or a preset) is applied by :func:`prepare` before; its
    autocast runs the forward under autocast, its compile under torch.compile with inductor's partitioner (what it
    saves is charged to the model as a whole: module hooks do not fire inside a compiled graph); parameters,
    gradients and optimizer states are one rank's shard. ``traced``: a whole step by :func:`traced_step` instead."""
    setup = as_setup(mode)
    if traced:
        return traced_step(model, inputs, setup)
    saved: dict[str, int] = {}
    ctx = _autocast(setup)
    if setup.compile:  # inductor's min-cut partitioner without its code generation: the same saved tensors
        torch._dynamo.reset()  # a fresh cache per model: a recompile limit would silently fall back to eager
        model.compile(backend="aot_eager_decomp_partition")  # in place: the module hooks fire once, outside
    block = first_block(model)
    seen_input: list[int] = []

    def grab(module, args, kwargs):  # the block's input hidden state: its first tensor argument
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if x is not None and not seen_input:
            seen_input.append(x.numel())

    hook = dict(model.named_modules())[block].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with charged(saved, list(model.parameters()), model), ctx, gpu_attention():
            out = model(**inputs)
    finally:
        hook.remove()
    _loss_of(out)  # a loss exists (the step is a training step)
    params = list(model.parameters())
    trained = [q for p, q in zip(params, per_rank(params, setup.shard)) if p.requires_grad]
    trainable = sum(p.numel() * p.element_size() for p in trained)
    total = stored_bytes(params, quantized_weights(model, setup), setup.shard)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    return StepMemory(total, trainable, optimizer_bytes(trained, setup.optimizer), saved, kinds, block,
                      seen_input[0] if seen_input else 0)


#: Where the memory alive at a traced step's peak is charged (module hooks cannot split it).
AT_PEAK = "(alive at the peak)"


def traced_step(model: nn.Module, inputs: dict, mode: str | Setup = "bf16") -> StepMemory:
    """A whole training step (forward, backward, AdamW step) under PyTorch's ``MemTracker``: the peak of the memory
    alive, by category, and its moment. For activation checkpointing, where the peak is not the end of the forward
    but the backward's recomputation of a block, with the checkpointed blocks' inputs and part of the gradients
    alive. AdamW's moments are made beforehand (as in every step after the first); gradients are set to None
    after the step, so the gradients counted are those alive at the peak. The drop-ins run as their custom ops
    (:func:`approxbp.kernels.ops.as_kernels`): each allocates what its kernel allocates, on fake and real tensors
    alike."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    from approxbp.kernels.ops import as_kernels

    setup = as_setup(mode)
    if setup.shard > 1 or setup.optimizer in ("adamw-8bit", "paged-adamw"):
        raise ValueError("--trace/--checkpoint run a real step of one process with torch's optimizers: not with "
                         f"--shard or --optimizer {setup.optimizer} (plan those without tracing)")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable) if setup.optimizer == "adamw" else torch.optim.SGD(trainable, lr=1e-3)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()
    no_hook = type("NoHook", (), {"remove": lambda self: None})()
    for p in model.parameters():  # MemTracker hooks every parameter's gradient, which fails on frozen ones (none)
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (no_hook, no_hook)
    tracker.track_external(model, opt)

    def peak_now() -> dict:  # the peak so far, by category (one device)
        return next(iter(tracker.get_tracker_snapshot("peak").values()))

    with as_kernels(), gpu_attention(), tracker:
        with _autocast(setup):
            loss = _loss_of(model(**inputs))
        after_forward = peak_now()["Total"]
        loss.backward()
        after_backward = peak_now()["Total"]
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = peak_now()
    moment = ("the optimizer step" if peak["Total"] > after_backward else
              "the backward" if peak["Total"] > after_forward else "the forward")
    for stats in tracker.memory_tracking.values():  # the innermost module whose local peak is the global one
        for state, phase in ((_ModState.PEAK_FW, "forward"), (_ModState.PEAK_BW, "backward")):
            if any(next(iter(snap.values()))["Total"] == peak["Total"] for snap in stats.snapshots.get(state, ())):
                if len(stats.mod_fqn) >= len(moment.partition(" of ")[2]):
                    moment = f"{phase} of {stats.mod_fqn}"
    alive = peak[_MemRefType.ACT] + peak[_MemRefType.TEMP] + peak[_MemRefType.OTH]
    return StepMemory(peak[_MemRefType.PARAM] + peak[_MemRefType.BUFFER], peak[_MemRefType.GRAD],
                      peak[_MemRefType.OPT], {AT_PEAK: alive}, {AT_PEAK: "alive at the peak"}, first_block(model),
                      moment=moment)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing as users turn it on: Hugging Face's ``gradient_checkpointing_enable`` (non-reentrant)
    where the model supports it; else each of the model's repeated blocks (:func:`first_block`'s ModuleList; the
    model itself without one) runs under ``torch.utils.checkpoint`` (non-reentrant), so only its inputs are kept
    and its forward is recomputed in the backward."""
    from torch.utils.checkpoint import checkpoint

    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5's name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    path = first_block(model)
    blocks = list(dict(model.named_modules())[path.rpartition(".")[0]]) if path else [model]
    for block in blocks:
        block.forward = (lambda inner: lambda *a, **k: checkpoint(inner, *a, use_reentrant=False, **k))(block.forward)
    return model


def first_block(model: nn.Module) -> str:
    """The path of entry 0 of the first ModuleList of two or more identical-typed modules (a model's blocks); "" (the
    model itself) for a model without repeated blocks, as the module: factories of approxbp.blocks."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            return f"{name}.0"
    return ""


def prepare(model: nn.Module, mode: str | Setup, lora_r: int = 8, checkpoint: bool = False) -> nn.Module:
    """The training set-up (a :class:`~approxbp.setup.Setup` or a ``--mode`` preset), on a model built under
    :func:`~approxbp.setup.weights_for`: ``train`` full (all trainable), lora (frozen, rank-``lora_r`` adapters on
    the set-up's targets, in peft's layout), lora-fa (the same with A frozen) or none (frozen); ``checkpoint``:
    activation checkpointing on top
    (:func:`checkpoint_blocks`; not with compile)."""
    setup = as_setup(mode)
    if checkpoint:
        if setup.compile:
            raise ValueError("--checkpoint with --mode compile: not supported (torch.compile's own activation "
                             "checkpointing is not modelled); plan bf16, autocast or lora with it")
        checkpoint_blocks(model)
    if setup.train in ("lora", "lora-fa"):
        add_lora(model, setup.lora_targets, lora_r, DTYPES.get(setup.adapters), freeze_a=setup.train == "lora-fa")
    elif setup.train == "none":
        model.requires_grad_(False)
    if setup.weights == "nf4":  # after freezing: the frozen base Linears are the quantised ones
        quantize_base(model)
    if setup.norms == "fp32":
        norms_in_fp32(model)
    return model.train()


# ---- models ----------------------------------------------------------------------------------------------------
#: Hugging Face configs of the papers' models, shipped so that a plan needs no download: hub id → file.
CONFIGS = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """The hub ids whose configs ship with approxbp (``approxbp plan google/vit-base-patch16-224-in21k``)."""
    return sorted(p.stem.replace("--", "/") for p in CONFIGS.glob("*.json"))


def model_spec(text: str, task: str | None = None) -> Callable[[], tuple[nn.Module, Callable[[int, int], dict]]]:
    """MODEL as the CLI takes it → a builder of (model, inputs(batch, seq)). A Hugging Face config JSON file, the hub
    id of a config that ships with approxbp (:func:`bundled_configs`), or a model type, each optionally followed by
    ``:key=value,…`` overrides (``llama:hidden=4096,layers=32,heads=32,intermediate=11008,vocab=32000``;
    ``text_config.hidden_act=gelu`` sets a nested config's field); or
    ``module:package.module:factory`` (the factory returns the model, or (model, inputs(batch, seq))). ``task``:
    the head (:mod:`approxbp.tasks`)."""
    if text.startswith("module:"):
        return _factory_spec(text)
    import transformers

    head, _, rest = text.partition(":")
    bundled = CONFIGS / (head.replace("/", "--") + ".json")
    source = bundled if "/" in head and bundled.is_file() else Path(head) if Path(head).suffix == ".json" else None
    if source is not None:
        fields = json.loads(source.read_text())
        kind = fields.pop("model_type", None)
        if kind is None:
            raise ValueError(f"{text}: a Hugging Face config needs its model_type")
    elif "/" in head:
        raise ValueError(f"{head}: no such config here (nothing is downloaded); give its config.json, or one of "
                         f"{', '.join(bundled_configs())}")
    else:
        kind, fields = head, {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{text}: expected key=value, got {item!r}")
        *parents, name = key.strip().split(".")  # text_config.hidden_act=gelu: a field of a nested config
        into = fields
        for parent in parents:
            into = into.setdefault(parent, {})
            if not isinstance(into, dict):
                raise ValueError(f"{text}: {key.strip()}: {parent} is not a nested config")
        into[CONFIG_KEYS.get(name, name)] = _config_value(value)
    try:
        config = transformers.AutoConfig.for_model(kind, **fields)
    except Exception as err:  # noqa: BLE001 - transformers' own validation errors, said in one line
        cause = " ".join(str(err).split())
        raise ValueError(f"{text}: transformers refused this config: {cause[-300:]}") from None

    return hf_builder(config, task)


def hf_builder(config, task: str | None = None) -> Callable[[], tuple[nn.Module, Callable[[int, int], dict]]]:
    """A builder of (the Hugging Face model of ``config`` with ``task``'s head (:func:`approxbp.tasks.task_of`),
    inputs(batch, seq) with its labels); ``config`` and ``task`` are kept on it."""
    task = task_of(config, task)

    def build():
        return build_task(config, task)
    build.config, build.task = config, task
    return build


def _config_value(value: str):
    """A config value as written after ``key=``: JSON (numbers, true, "text", lists), else the bare text
    (``hidden_act=relu``)."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value.strip()


def _factory_spec(text: str):
    """``module:package.module:factory`` → a builder; import and type errors are said in one line."""
    parts = text.split(":", 2)
    if len(parts) != 3 or not all(parts[1:]):
        raise ValueError(f"{text}: expected module:package.module:factory")
    _, mod, fn = parts
    try:
        factory = getattr(importlib.import_module(mod), fn)
    except ImportError as err:
        raise ValueError(f"{text}: cannot import {mod} ({err})") from None
    except AttributeError:
        raise ValueError(f"{text}: {mod} has no {fn}") from None
    if not callable(factory):
        raise TypeError(f"{text}: {mod}.{fn} is not callable")

    def build():
        made = factory()
        model = made[0] if isinstance(made, tuple) and made else made
        if not isinstance(model, nn.Module) or (isinstance(made, tuple) and (len(made) != 2 or not callable(made[1]))):
            raise TypeError(f"{text}: the factory must return an nn.Module or (model, inputs(batch, seq)), got "
                            f"{type(made).__name__}")
        if isinstance(made, tuple):
            return made
        return made, lambda b, n: {"input": torch.randn(b, n, _width(made))}
    return build


def _no_init():
    """Weight initialisation skipped (fake tensors have no values, and truncated-normal init reads them)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _width(model: nn.Module) -> int:
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ValueError("module: factory returned a model without a Linear; return (model, inputs(batch, seq))")
    return first.in_features


# ---- options -----------------------------------------------------------------------------------------------------
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
    from approxbp.kernels.patch import patch_model

    tables = {path: option_table(act, assignment[path]) or "exact"
              for path, act in activation_layers(model).items() if path in assignment}
    fused = {path.rpartition(".")[0] for path, option in assignment.items() if option == "glu"}
    patch_model(model, family=None, tables=tables or None, norms=ms_norm, example_input=inputs, check=False, glu=fused)
    return model


# ---- the plan -------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    model: str
    mode: str
    batch: int
    seq: int | None  # None: the model's inputs do not depend on it
    budget: int | None
    before: dict
    after: dict
    layers: dict[str, dict]  # path → {"activation", "option", "saving", "error"}
    options: dict[str, dict]  # activation → option → {"saving per layer", "error"}
    ms_norm: dict
    estimate: int | None = None  # the knapsack's additive prediction of the peak; ``after`` is measured
    checkpoint: bool = False  # activation checkpointing
    traced: bool = False  # a whole step traced (MemTracker) rather than the forward's saved tensors
    use: str | None = None  # the assignment evaluated (--use), or None: chosen by the planner

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _summary(m: StepMemory) -> dict:
    units = m.block_units
    return {"parameters": m.parameters, "gradients": m.gradients, "optimizer": m.optimizer,
            "activations": m.activations, "peak": m.peak, "activations_by_kind": m.by_kind(),
            "block": m.block, "block_units": None if units is None else round(units, 4), "peak_moment": m.moment,
            "blocks_measured": list(m.blocks_measured)}


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

    def one(builder, batch: int, seq: int, assignment: dict[str, str] | None, ms_norm: bool) -> StepMemory:
        with scope():
            torch.manual_seed(0)
            with weights_for(setup), _no_init() if fake else contextlib.nullcontext():
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
         fake: bool = True, progress=None, checkpoint: bool = False, traced: bool | None = None) -> Plan:
    """Measure the exact model and each option, then choose (see the module docstring; ``checkpoint``, ``traced``:
    :func:`stepper`'s)."""
    say = progress or (lambda msg: None)
    step = stepper(model_text, mode, lora_r, fake, checkpoint, traced)

    def run(assignment: dict[str, str] | None, ms_norm: bool) -> StepMemory:
        return step(batch, seq, assignment, ms_norm)

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
    ms = {"saving": base.peak - merged.peak}
    target = budget
    for _ in range(4):  # savings are measured per option; their sum can be off by what options share: re-measure
        choice = _choose(layers, options, ms["saving"], base.peak, target)
        ms["chosen"] = choice.pop("__ms_norm__") == "on"
        estimate = base.peak - sum(options[layers[p]][o]["saving_per_layer"] for p, o in choice.items()) - (
            ms["saving"] if ms["chosen"] else 0)
        say("the chosen plan")
        after = run(choice, ms["chosen"])
        if budget is None or after.peak <= budget:
            break
        target -= after.peak - budget
    else:
        raise ValueError(f"no assignment was measured within the budget ({size(after.peak)} > {size(budget)})")
    return Plan(model_text, as_setup(mode).describe(), batch, seq if base.uses_seq else None, budget, _summary(base),
                _summary(after),
                {p: {"activation": layers[p], "option": o, "table": option_table(layers[p], o),
                     **options[layers[p]][o]} for p, o in choice.items()},
                options, ms, estimate, checkpoint, bool(base.moment))  # only a traced step has a moment


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
        plans.append(Plan(model_text, as_setup(mode).describe(), batch, seq if base.uses_seq else None, budget,
                          _summary(base), _summary(after), layers, {}, {"chosen": ms, "saving": None}, None, checkpoint,
                          bool(base.moment), use))
    return plans


#: --maximize seq_len searches multiples of this many tokens.
SEQ_GRAIN = 64
#: --maximize probes batch sizes and sequence lengths up to this (a larger one is no device's step).
MAX_PROBE = 1 << 20


def maximize(model_text: str, what: str, batch: int, seq: int, mode: str | Setup, budget: int, lora_r: int = 8,
             progress=None, checkpoint: bool = False, traced: bool | None = None,
             use: str | None = None, grain: int = SEQ_GRAIN) -> tuple[int, Plan]:
    """The largest ``what`` (``batch`` or ``seq_len``) whose step fits ``budget`` with the most-saving replacements
    (chosen at the given sizes) or with the assignment ``use`` (:func:`parse_use`; ``exact`` for the stock model),
    by doubling then bisection (sequence lengths in multiples of ``grain`` tokens), one fake step per probe; then
    the least-error plan (or ``use``'s evaluation) at that size."""
    if what not in ("batch", "seq_len"):
        raise ValueError(f"--maximize {what!r}: expected batch or seq_len")
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
        raise ValueError(f"no assignment fits: the exact step peaks at {size(peak)}, {size(need)} over the budget, "
                         f"and the options save at most {size(top)}")
    unit = max(1, top // 4096)
    cap = -(-need // unit)  # units to save, rounded up; savings are rounded down: the choice is never short
    best = np.full(cap + 1, np.inf)  # best[s]: least error saving s units (s = cap: at least cap)
    best[0] = 0.0
    trail = []
    for _, opts in groups:
        new, pick, source = np.full(cap + 1, np.inf), np.zeros(cap + 1, int), np.zeros(cap + 1, int)
        for j, (_, saving, error) in enumerate(opts):
            k = min(saving // unit, cap)
            cand, src = np.full(cap + 1, np.inf), np.arange(cap + 1) - k
            cand[k:cap] = best[:cap - k] + error
            top_src = cap - k + int(np.argmin(best[cap - k:]))  # any s ≥ cap − k reaches the cap
            cand[cap], src[cap] = best[top_src] + error, top_src
            better = cand < new
            new[better], pick[better], source[better] = cand[better], j, src[better]
        trail.append((pick, source))
        best = new
    if not np.isfinite(best[cap]):
        raise ValueError("no assignment fits the budget")
    out, i = {}, cap
    for (path, opts), (pick, source) in zip(reversed(groups), reversed(trail)):
        out[path] = opts[pick[i]][0]
        i = source[i]
    return out


# ---- output ---------------------------------------------------------------------------------------------------
CATEGORIES = ("parameters", "gradients", "optimizer")


def _title(p: Plan, short: bool = False) -> str:
    return " · ".join([p.model.split(":")[0] if short else p.model,
                       p.mode + (" + checkpointing" if p.checkpoint else "") + (", traced" if p.traced else ""),
                       f"batch {p.batch}", *([f"seq {p.seq}"] if p.seq is not None else [])])


def report(p: Plan) -> str:
    """The plan as text: the step before and after by category, the options per activation, the choice."""
    lines = [_title(p) + (f" · budget {size(p.budget)}" if p.budget else ""),
             f"{'':<28}{'exact':>12}{'planned':>12}"]
    for key in (*CATEGORIES, "activations", "peak"):
        lines.append(f"  {key:<26}{size(p.before[key]):>12}{size(p.after[key]):>12}")
    if p.before.get("peak_moment"):
        lines.append(f"  {'peak reached in':<26}{p.before['peak_moment']} / {p.after['peak_moment']} (a traced step: "
                     "gradients and activations alive then)")
    for kind in sorted(set(p.before["activations_by_kind"]) | set(p.after["activations_by_kind"])):
        lines.append(f"    {kind:<24}{size(p.before['activations_by_kind'].get(kind, 0)):>12}"
                     f"{size(p.after['activations_by_kind'].get(kind, 0)):>12}")
    if p.before.get("block_units") is not None and p.after.get("block_units") is not None:
        lines.append(f"  {'one block, App. B units':<26}{p.before['block_units']:>12.3f}"
                     f"{p.after['block_units']:>12.3f}   ({p.before['block'] or 'the model'}: saved bytes / a 16-bit "
                     "[b, n, c] tensor)")
    if p.before.get("blocks_measured"):
        lines.append(f"  (its blocks are alike: measured at {' and '.join(map(str, p.before['blocks_measured']))} "
                     "blocks and extrapolated, approxbp/extrapolate.py)")
    if p.use is None:
        lines.append("options (saving of the peak per layer, measured in this graph; gradient error: "
                     "E_N(0,1)[(h̃′ − f′)²]^½ or InvAct's certified L∞):")
        for act, opts in p.options.items():
            lines.append("  " + act + ": " + ", ".join(f"{o} {size(v['saving_per_layer'])} / {v['error']:.2g}"
                                                      for o, v in opts.items()))
        lines.append(f"  MS-norms (all mergeable norms): {size(p.ms_norm['saving'])}, exact; "
                     f"{'chosen' if p.ms_norm['chosen'] else 'not chosen'}")
    else:
        lines.append(f"the given assignment (--use {p.use}); MS-norms {'on' if p.ms_norm['chosen'] else 'off'}; "
                     "gradient error per layer: E_N(0,1)[(h̃′ − f′)²]^½ or InvAct's certified L∞")
    chosen: dict[str, list[str]] = {}
    for path, layer in sorted(p.layers.items()):
        error = f" (error {layer['error']:.2g})" if p.use else ""
        chosen.setdefault(f"{layer['activation']} → {layer['option']}{error}", []).append(path)  # not a table
    lines.append("choice:" if p.use is None else "assignment:")
    lines += [f"  {what}: {len(paths)} layers ({paths[0]}{', …' if len(paths) > 1 else ''})"
              for what, paths in chosen.items()]
    return "\n".join(lines)


#: One colour per category in every figure (tab10's), so that two plans' figures read alike.
COLOURS = {"parameters": 0, "gradients": 1, "optimizer": 2, "activation functions": 3, "norms": 4,
           "linear / embedding inputs": 5, "attention": 6, "MLP products (SwiGLU)": 8, "other": 7, AT_PEAK: 9}


def figure(p: Plan, path: Path) -> Path:
    """Stacked bars of the step's memory by category, exact and planned (as Approx-BP's Fig. 2): fixed colours per
    category, the budget as a line, the saving written over the planned bar."""
    import io
    import textwrap

    import matplotlib
    from matplotlib.figure import Figure

    from approxbp.approximations.files import write_atomic

    kinds = sorted(set(p.before["activations_by_kind"]) | set(p.after["activations_by_kind"]),
                   key=lambda k: COLOURS.get(k, 99))
    palette = matplotlib.colormaps["tab10"]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for i, step in enumerate((p.before, p.after)):
        bottom = 0.0
        for key in (*CATEGORIES, *kinds):
            v = (step[key] if key in CATEGORIES else step["activations_by_kind"].get(key, 0)) / 2**30
            ax.bar(i, v, bottom=bottom, color=palette(COLOURS.get(key, 7)), label=key if i == 0 else None, width=0.55)
            bottom += v
    before, after = p.before["peak"], p.after["peak"]
    saved = before - after
    note = (f"−{size(saved)} ({-100 * saved / before:.0f} %)" if saved > 0 else
            "the exact step fits the budget:\nnothing replaced" if p.budget and before <= p.budget else "no saving")
    ax.annotate(note, (1, after / 2**30), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                fontsize=9)
    if p.budget:
        ax.axhline(p.budget / 2**30, color="black", linestyle="--", linewidth=1, label=f"budget {size(p.budget)}")
    ax.set_ylim(0, max(before, after, p.budget or 0) / 2**30 * 1.15)
    ax.set_xticks([0, 1], ["exact", "planned" if p.use is None else f"--use {p.use}"[:24]])
    ax.set_ylabel("GiB")
    ax.set_title("\n".join(textwrap.wrap(_title(p, short=True), 64)), fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return write_atomic(Path(path), buf.getvalue())
