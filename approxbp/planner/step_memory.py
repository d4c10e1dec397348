"""One training step's memory (Approx-BP Fig. 2's categories): parameters, gradients, optimizer states and the
tensors autograd saves for backward, each charged to the module running when it was saved; on fake tensors (a plan)
or real ones (the tests' reference). :func:`traced_step` traces a whole step with PyTorch's ``MemTracker`` instead
(activation checkpointing: the peak is then inside the backward)."""

from __future__ import annotations

import gc
import hashlib
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from approxbp.kernels.ops.saved import charged
from approxbp.kernels.ops.torch_private import dynamo_reset
from approxbp.planner.attention import as_a_gpu_runs_it
from approxbp.planner.training import (
    DTYPES,
    Setup,
    add_lora,
    as_setup,
    held_by_module,
    norms_in_fp32,
    optimizer_bytes,
    per_rank,
    quantize_base,
    quantized_weights,
    stored_bytes,
)

__all__ = ["AT_PEAK", "checkpoint_blocks", "first_block", "fsdp2_rank", "GATHERED", "measure", "parse_size",
           "prepare", "repeated_blocks", "size", "StepMemory", "traceable", "traced_step",
           "weight_shapes"]


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
    lora: tuple[str, ...] = ()  # the names of the Linears LoRA adapted (what --lora-targets matched)
    head: str = ""  # the head the model was built with, and why (approxbp.planner.tasks.head_of)
    held: dict[str, int] = field(default_factory=dict)  # module path → its parameters, gradients, optimizer states
    devices: int = 1  # GPUs the model is split over by blocks (Setup.devices)

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

    def device_peaks(self) -> list[int]:
        """Each GPU's peak when the model is split over :attr:`devices` by blocks, as Hugging Face's
        ``device_map="auto"`` places a model of alike blocks (accelerate's balanced map): the blocks in contiguous
        runs of equal count, the modules before them (embeddings) on the first GPU and those after them (final
        norm, head) on the last; a GPU's peak is what its modules hold and save. Their sum is :attr:`peak` (the
        hidden state handed from one GPU to the next is a copy the sender frees, unless a module of its own saved
        it, when it is counted there too; that copy is left out)."""
        prefix = self.block.rpartition(".")[0] + "." if self.block else ""
        paths = list(dict.fromkeys([*self.kinds, *self.held, *self.saved]))
        index = {p: int(m[1]) for p in paths if prefix and (m := re.match(re.escape(prefix) + r"(\d+)(\.|$)", p))}
        blocks = max(index.values(), default=-1) + 1
        first = next((i for i, p in enumerate(paths) if p in index), len(paths))
        peaks = [0] * self.devices
        for i, path in enumerate(paths):
            if path in index:
                gpu = index[path] * self.devices // blocks
            else:  # outside the blocks: before them on the first GPU, after them (and the model itself) on the last
                gpu = 0 if i < first and path else self.devices - 1
            peaks[gpu] += self.held.get(path, 0) + self.saved.get(path, 0)
        return peaks

    def by_kind(self) -> dict[str, int]:
        """Saved bytes by category of the saving module: activation, norm, linear, attention, other."""
        from approxbp.kernels.ops.modules import drop_in_classes

        ours = {c.__name__ for c in drop_in_classes()}  # the registered families' drop-ins, walked once
        out: dict[str, int] = {}
        for path, b in self.saved.items():
            kind = _category(self.kinds.get(path, ""), ours)
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


def _category(kind: str, ours: set[str]) -> str:
    """The category of a module class name; ``ours``: the drop-in activation classes' names."""
    from approxbp.kernels.rewrite.patch import ACTIVATION_CLASSES

    low = kind.lower()
    if kind == _GATHERED_KIND:
        return kind
    if kind in ACTIVATION_CLASSES or kind in ours or "activation" in low or kind in ("GELU", "SiLU", "Mish"):
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
    saved). The set-up (:class:`~approxbp.planner.training.Setup` or a preset) is applied by :func:`prepare` before; its
    autocast runs the forward under autocast, its compile under torch.compile with inductor's partitioner (what it
    saves is charged to the model as a whole: module hooks do not fire inside a compiled graph); parameters,
    gradients and optimizer states are one rank's shard. ``traced``: a whole step by :func:`traced_step` instead."""
    setup = as_setup(mode)
    if traced:
        return traced_step(model, inputs, setup)
    saved: dict[str, int] = {}
    ctx = _autocast(setup)
    if setup.compile:  # inductor's min-cut partitioner without its code generation: the same saved tensors
        dynamo_reset()  # a fresh cache per model: a recompile limit would silently fall back to eager
        model.compile(backend="aot_eager_decomp_partition")  # in place: the module hooks fire once, outside
    block = first_block(model)
    seen_input: list[int] = []

    def grab(module, args, kwargs):  # the block's input hidden state: its first tensor argument
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if x is not None and not seen_input:
            seen_input.append(x.numel())

    hook = dict(model.named_modules())[block].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with charged(saved, list(model.parameters()), model), ctx, as_a_gpu_runs_it():
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
                      seen_input[0] if seen_input else 0, devices=setup.devices,
                      held=held_by_module(model, setup) if setup.devices > 1 else {})  # only a split reads it


#: Where the memory alive at a traced step's peak is charged (module hooks cannot split it).
AT_PEAK = "(alive at the peak)"
#: Where an FSDP2 rank's gathered (unsharded) parameters and one block's unsharded gradients are charged.
GATHERED, _GATHERED_KIND = "(FSDP2 gathered)", "FSDP2 gathered parameters"


def fsdp2_rank(one: StepMemory, model: nn.Module, setup: Setup) -> StepMemory:
    """One rank's peak under FSDP2 as users wrap a model (``fully_shard`` on each of its blocks, then on the model),
    from ``one``, the whole step traced on one device: what is alive at its peak and its gradients at that moment
    (sharded) and, per rank, the parameters' and optimizer states' shards (dim 0 split, padded, as FSDP2 does), the
    root's own parameters gathered for the whole step (the root is not resharded after the forward), and two blocks'
    parameters gathered with one block's unsharded gradients (the block running, the one prefetched on a GPU's
    all-gather stream, and a block's gradients before their reduce-scatter). A rank of a real CPU step (gloo, two
    processes) peaks within the bound (tests/approxbp/planner/test_shard_peak.py)."""
    params, quantized = list(model.parameters()), quantized_weights(model, setup)
    trained = [p for p in params if p.requires_grad]
    shards = per_rank(trained, setup.shard)
    share = sum(q.numel() for q in shards) / max(1, sum(p.numel() for p in trained))

    def full(ps) -> int:  # gathered: every element, stored as the model stores it (one rank of one)
        return stored_bytes(list(ps), quantized, 1)

    blocks = repeated_blocks(model)
    inside = {id(p) for b in blocks for p in b.parameters()}
    block = max((full(b.parameters()) for b in blocks), default=0)
    block_grads = max((full(p for p in b.parameters() if p.requires_grad) for b in blocks), default=0)
    gathered = full(p for p in params if id(p) not in inside) + 2 * block + block_grads
    return StepMemory(stored_bytes(params, quantized, setup.shard), math.ceil(one.gradients * share),
                      optimizer_bytes(shards, setup.optimizer), {**one.saved, GATHERED: gathered},
                      {**one.kinds, GATHERED: _GATHERED_KIND}, one.block, moment=one.moment)


def traceable(setup: Setup) -> bool:
    """A step :func:`traced_step` runs: one device per rank (FSDP2 ranks: :func:`fsdp2_rank`) with torch's own
    optimizers."""
    return setup.devices == 1 and setup.optimizer in ("adamw", "sgd")


def traced_step(model: nn.Module, inputs: dict, mode: str | Setup = "bf16") -> StepMemory:
    """A whole training step (forward, backward, AdamW step) under PyTorch's ``MemTracker``: the peak of the memory
    alive, by category, and its moment. For activation checkpointing, where the peak is not the end of the forward
    but the backward's recomputation of a block, with the checkpointed blocks' inputs and part of the gradients
    alive. AdamW's moments are made beforehand (as in every step after the first); gradients are set to None
    after the step, so the gradients counted are those alive at the peak (``setup.accumulate``: alive from the start, as
in gradient accumulation's later micro-batches). The drop-ins run as their custom ops
    (:func:`~approxbp.kernels.ops.custom_ops.as_kernels`): each allocates what its kernel allocates, on fake and
    real tensors alike. Sharded over N ranks (``setup.shard``): one rank's step, :func:`fsdp2_rank` of the step
    traced on one device."""
    from dataclasses import replace

    from torch.distributed._tools.mem_tracker import _MemRefType

    from approxbp.kernels.ops.custom_ops import as_kernels
    from approxbp.planner.moves import host_elsewhere
    from approxbp.planner.tracker import Tracker

    setup = as_setup(mode)
    if not traceable(setup):
        raise ValueError("--trace/--checkpoint run a real step on one device per rank with torch's optimizers: "
                         f"not with --devices or --optimizer {setup.optimizer} (plan those without tracing)")
    if setup.shard > 1:
        return fsdp2_rank(traced_step(model, inputs, replace(setup, shard=1)), model, setup)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable) if setup.optimizer == "adamw" else torch.optim.SGD(trainable, lr=1e-3)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    if not setup.accumulate:  # accumulating, a micro-batch after the first starts with every gradient
        opt.zero_grad(set_to_none=True)
    tracker = Tracker()
    no_hook = type("NoHook", (), {"remove": lambda self: None})()
    for p in model.parameters():  # MemTracker hooks every parameter's gradient, which fails on frozen ones (none)
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (no_hook, no_hook)
    tracker.track_external(model, opt)

    def peak_now() -> dict:  # the peak so far, by category (one device)
        return next(iter(tracker.get_tracker_snapshot("peak").values()))

    with as_kernels(), as_a_gpu_runs_it(), host_elsewhere(), _collecting_only_the_steps_objects(), tracker:
        with _autocast(setup):  # (host_elsewhere: offloaded tensors leave, as on a GPU)
            loss = _loss_of(model(**inputs))
        gc.collect()  # at both phase ends: the automatic collector's timing cannot move a real step's peak
        after_forward = peak_now()["Total"]
        loss.backward()
        gc.collect()  # (MemTracker's references can tie a shared-output norm's y and z into a cycle that only the
        after_backward = peak_now()["Total"]  # collector frees; plain training frees them at once)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = peak_now()
    moment = tracker.innermost_at(peak["Total"]) or (
        "the optimizer step" if peak["Total"] > after_backward else
        "the backward" if peak["Total"] > after_forward else "the forward")
    alive = peak[_MemRefType.ACT] + peak[_MemRefType.TEMP] + peak[_MemRefType.OTH]
    return StepMemory(peak[_MemRefType.PARAM] + peak[_MemRefType.BUFFER], peak[_MemRefType.GRAD],
                      peak[_MemRefType.OPT], {AT_PEAK: alive}, {AT_PEAK: "alive at the peak"}, first_block(model),
                      moment=moment)


@contextmanager
def _collecting_only_the_steps_objects():
    """``gc.freeze`` for the step: what existed before it (torch, transformers, the model) is left out of every
    collection inside it, so :func:`traced_step`'s two ``gc.collect`` examine only the objects the step made (the
    cycles it may leave are among those), in microseconds rather than a walk of the whole heap (~0.2 s each). Older
    garbage holds no tensor the step's tracker counts; ``gc.unfreeze`` hands it back to the collector after. A
    process that froze objects itself (a pre-fork server) is left as it was: nothing more is frozen, nothing thawed."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
    for block in repeated_blocks(model) or [model]:
        block.forward = (lambda inner: lambda *a, **k: checkpoint(inner, *a, use_reentrant=False, **k))(block.forward)
    return model


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (the ModuleList of :func:`first_block`); none for a model without them."""
    path = first_block(model)
    return list(dict(model.named_modules())[path.rpartition(".")[0]]) if path else []


def first_block(model: nn.Module) -> str:
    """The path of entry 0 of the first ModuleList of two or more identical-typed modules (a model's blocks); "" (the
    model itself) for a model without repeated blocks, as the module: factories of approxbp.blocks."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            return f"{name}.0"
    return ""


def prepare(model: nn.Module, mode: str | Setup, lora_r: int = 8, checkpoint: bool = False) -> nn.Module:
    """The training set-up (a :class:`~approxbp.planner.training.Setup` or a ``--mode`` preset), on a model built under
    :func:`~.training.weights_for`: ``train`` full (all trainable), lora (frozen, rank-``lora_r`` adapters on
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
        add_lora(model, setup.lora_targets, lora_r, DTYPES.get(setup.adapters), freeze_a=setup.train == "lora-fa",
                 dropout=setup.lora_dropout)
    elif setup.train == "none":
        model.requires_grad_(False)
    if setup.weights == "nf4":  # after freezing: the frozen base Linears are the quantised ones
        quantize_base(model)
    if setup.norms == "fp32":
        norms_in_fp32(model)
    return model.train()


def weight_shapes(model: nn.Module) -> str:
    """The model's weights as a plan records them: "N tensors, M elements, <digest of their sorted shapes>" over its
    parameters less peft's (LoRA factors, ``modules_to_save`` copies), so a peft-wrapped model matches its base
    model's plan; names are not read (a wrapper renames them), shapes are."""
    shapes = sorted(tuple(p.shape) for n, p in model.named_parameters()
                    if "lora_" not in n and "modules_to_save" not in n)
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    return f"{len(shapes)} tensors, {sum(math.prod(s) for s in shapes)} elements, shapes {digest}"
