"""approxbp inside Hugging Face ``Trainer`` and TRL's trainers: one callback.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ApproxBPCallback(family="invact", chunked_loss=True)])

Why a callback: it is the one object ``Trainer`` and every TRL trainer (SFT, DPO, GRPO, KTO, GKD: subclasses of
``Trainer``) accept unchanged, and ``on_train_begin`` hands it the model the trainer trains — after peft, whichever
way accelerate wraps it — with the optimizer already holding its Parameters (every rewrite keeps them: the same
objects). The patch itself waits for the model's first training call (a ``forward`` set on the model that removes
itself, patches, and runs that call through the patched model: every move in force from step 1; an evaluation or a
generation before it runs stock and waits): its arguments, by name, are ``patch_model``'s ``example_input``, so the
rewrites are proven and measured on the shapes the run trains on, outside autocast (the proof compares with stock in
the model's own dtype). Then the plan's
moves (``approxbp.planner.moves.apply_moves``: ``"recompute"``, ``"offload"`` per block path; the chunked loss)
are applied to the transformers model. The report (saved bytes, every skip with its reason) is logged once and kept
as ``callback.report``. A second model handed to the same callback (another Trainer, ``model_init``) is patched too
(planned anew under a budget); ``callback.report`` then describes it. Where the trainer computes the loss from the
logits (``label_smoothing_factor``), ``chunked_loss=True`` is refused and a budget is planned without it.

Checkpoints: a patched model's state dict is the stock model's (the rewrites keep every Parameter under its stock
name and merge nothing), so ``save_model``, ``save_steps`` checkpoints and ``push_to_hub`` load into the stock class
with the trained values (tested).
"""

from __future__ import annotations

import inspect
import json
import logging
import weakref
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from approxbp.kernels.rewrite.bound_forward import BoundForward, install_forward, uninstall_forward
from approxbp.planner.chunked_loss import refusal as chunked_loss_refusal
from approxbp.planner.gpus import DEFAULT_GPU
from approxbp.planner.gpus import gpu as step_gpu
from approxbp.planner.moves import apply_moves, block_moves
from approxbp.planner.step_memory import parse_size

__all__ = ["ApproxBPCallback", "longest_sequence", "plan_for", "trainer_setup", "TRL_FUSED_HEAD"]

_logger = logging.getLogger("approxbp")


class ApproxBPCallback(TrainerCallback):
    """Patch the trained model on its first training call (its first batch), one of three ways:

    - ``patch`` (``patch_model``'s keyword arguments: ``family``, ``tables``, ``norms``, ``glu``, ``bits``,
      ``module_filter_fn``), ``moves`` (block path → move, as ``approxbp plan --out`` writes them) and
      ``chunked_loss``: ``patch_model(model, example_input=<that batch>, **patch)``, then ``apply_moves``;
    - ``plan``: a plan file (``approxbp plan --out``) or :class:`~approxbp.planner.result.Plan`, applied as it is;
    - ``budget`` (bytes or ``"24GiB"``) with ``gpu`` (default h100) and ``setup`` (a
      :class:`~approxbp.planner.training.Setup` or preset name; default: read off the trainer, :func:`trainer_setup`):
      the model's config planned on fake tensors at the first batch's size and the run's longest sequence
      (:func:`longest_sequence`), and the fastest plan that fits applied (``callback.plan`` keeps it); with it,
      ``tables=[FILE, …]`` offers a user's tables to that search (``approxbp plan --table``), and
      ``chunked_loss=False`` plans without the chunked loss (a compute_loss of your own reads the logits). It is
      planned without it anyway where the trainer computes the loss itself (label smoothing, a first training call
      without labels), said; a later batch past the planned shape is warned once; TRL's fused LM head (TRL ≥ 1.x
      trainers), whose loss the planner does not trace, is refused at ``on_train_begin``. ``resident=[module, …]``:
      models the trainer holds beside the trained one (a reference model, a teacher; the callback is handed only the
      trained one), their weights taken off the budget before planning."""

    def __init__(self, *, plan=None, budget: int | str | None = None, gpu: str | None = None, setup=None,
                 moves: dict[str, str] | None = None, chunked_loss: bool | None = None, resident=(), **patch):
        from approxbp.kernels.rewrite.patch import patch_model
        from approxbp.planner.result import Plan

        unknown = sorted(set(patch) - set(patch_model.__kwdefaults__) - {"config"})
        if unknown or "example_input" in patch:
            raise TypeError(f"ApproxBPCallback: {', '.join(unknown) or 'example_input'} is not an argument of "
                            "patch_model it passes on (the example input is the trainer's first batch)")
        offered = ()  # with a budget, tables=[FILE, …]: a user's tables offered to the search (approxbp plan --table)
        if budget is not None and isinstance(patch.get("tables"), list | tuple):
            offered = tuple(str(t) for t in patch.pop("tables"))
        given = [name for name, v in (("plan", plan), ("budget", budget), ("moves", moves or chunked_loss),
                                      ("patch_model's", patch)) if v]
        if len(given) > 1 and given != ["moves", "patch_model's"]:
            raise TypeError(f"ApproxBPCallback: {' and '.join(given)} arguments together: a plan carries its own "
                            "layers, norms and moves, and a budget plans them; give one")
        if budget is None and (gpu is not None or setup is not None):
            raise TypeError("ApproxBPCallback: gpu= and setup= describe the step planned from budget=; give budget=")
        self.plan = Plan.load(plan) if isinstance(plan, str | Path) else plan
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise TypeError(f"ApproxBPCallback: plan= takes a plan file or a Plan, not {type(plan).__name__}")
        self.budget = parse_size(budget) if isinstance(budget, str) else budget
        if self.budget is not None and (not isinstance(self.budget, int) or isinstance(self.budget, bool)
                                        or self.budget <= 0):
            raise ValueError(f"ApproxBPCallback: budget={budget!r}: expected bytes (a positive int) or a size such "
                             "as '24GiB'")
        if gpu is not None:
            step_gpu(gpu)  # an unknown name refused now, not on the first batch
        self.resident = tuple(resident)
        if self.resident and (self.budget is None or not all(isinstance(m, nn.Module) for m in self.resident)):
            raise TypeError("ApproxBPCallback: resident= takes the modules held beside the trained one (a reference "
                            "model, a teacher), with budget=")
        if not isinstance(chunked_loss, bool | None):
            raise TypeError(f"ApproxBPCallback: chunked_loss={chunked_loss!r}: expected True or False")
        try:
            block_moves(moves or {})  # refused now, not on the first batch
        except ValueError as err:
            raise ValueError(f"ApproxBPCallback: moves=: {err}") from None
        self.gpu, self.setup, self.patch, self.moves = gpu, setup, patch, dict(moves or {})
        self.chunked_loss, self.offered = chunked_loss, offered
        self.report, self._model, self._args, self._warned, self._held = None, None, None, False, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise RuntimeError("ApproxBPCallback: the trainer handed no model to on_train_begin")
        self._args = args
        if self._model is not None and self._model() is model:
            return  # this model is patched (or waits for its first training call): a resumed or second train()
        if self._model is not None:  # another model (a second Trainer, model_init): patched too, planned anew
            _logger.info("approxbp: a new model (%s) in this callback: patched on its first batch too; "
                         "callback.report will describe it", type(model).__name__)
            self.report = None
            if self.budget is not None:
                self.plan = None
        self._model = weakref.ref(model)
        self._longest = longest_sequence(kwargs.get("train_dataloader"))
        chunked = self.chunked_loss or (self.plan is not None and self.plan.chunked_loss)
        _refuse_unchunkable_loss(args, chunked)
        if self.budget is not None and _trl_fused_head(_base(model)):
            raise ValueError(TRL_FUSED_HEAD)
        if chunked and (why := chunked_loss_refusal(_base(model))):
            raise ValueError(f"ApproxBPCallback: chunked loss: {why}; drop chunked_loss (or plan without it)")
        _install_first_call(model, self._patch)

    def _patch(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Patch ``model`` on the arguments of its first training call (the example input), every move in force
        before that call's forward runs."""
        from approxbp.kernels.rewrite.patch import patch_model

        example = _keywords(model, args, kwargs)
        base = _base(model)
        with torch.autocast(next(model.parameters()).device.type, enabled=False):
            if self.budget is not None:
                self.plan = plan_for(model, example, self._budget_left(model), gpu=self.gpu,
                                     setup=self.setup or trainer_setup(self._args, model),
                                     checkpoint=bool(getattr(self._args, "gradient_checkpointing", False)),
                                     chunked_loss=self._may_chunk(example), longest=self._longest,
                                     tables=self.offered)
            if self.plan is not None:
                self.report = self.plan.apply(base, example_input=example)
            else:
                self.report = patch_model(model, example_input=example, **self.patch)
                if self.moves or self.chunked_loss:
                    apply_moves(base, self.moves, chunked_loss=bool(self.chunked_loss))
        _logger.info("approxbp: %s", self.report)
        if self.budget is not None:
            _watch_shape(model, self.plan.batch, self.plan.seq)

    def _budget_left(self, model: nn.Module) -> int:
        """The budget less the ``resident`` modules' weights and buffers (each storage once; those the trained model
        shares not counted): what the trained model's step may take."""
        own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        held = {}
        for m in self.resident:
            for t in (*m.parameters(), *m.buffers()):
                if (ptr := t.untyped_storage().data_ptr()) not in own:
                    held[ptr] = t.untyped_storage().nbytes()
        if sum(held.values()) >= self.budget:
            raise ValueError(f"ApproxBPCallback: the resident modules hold {sum(held.values())} bytes, the whole "
                             f"budget {self.budget}")
        if held:
            _logger.info("approxbp: the resident modules hold %d bytes: the step is planned within the %d left of the "
                         "budget", sum(held.values()), self.budget - sum(held.values()))
        self._held = sum(held.values())
        return self.budget - self._held

    def _may_chunk(self, example: dict) -> bool:
        """Whether a budget may count on the chunked loss: not where it is turned off (``chunked_loss=False``: a
        compute_loss of the user's reads the logits), where the trainer computes the loss from the logits (label
        smoothing), or where the training call carries no labels (the model computes no loss: said)."""
        if self.chunked_loss is False:
            return False
        why = ("the trainer computes the loss from the logits (label smoothing)" if not _loss_reaches_model(self._args)
               else "the first training call carries no labels (the trainer computes the loss itself)"
               if example.get("labels") is None else None)
        if why:
            _logger.warning("approxbp: %s: the budget is planned without the chunked loss", why)
        return why is None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        device = _cuda_device(model)
        if device is not None and self.budget is not None:
            torch.cuda.reset_peak_memory_stats(device)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """On a GPU under a budget: the step's real peak (``torch.cuda.max_memory_allocated``, reset at each step's
        start) against the budget and the plan's traced peak — logged at the first step, warned once over it."""
        device = _cuda_device(model)
        if device is None or self.budget is None or self.plan is None:
            return
        peak, planned = torch.cuda.max_memory_allocated(device), self.plan.after.peak + self._held
        if state.global_step <= 1:
            _logger.info("approxbp: step %d peaked at %d bytes on %s (planned %d, budget %d)", state.global_step,
                         peak, device, planned, self.budget)
        if peak > self.budget and not self._warned:
            self._warned = True
            _logger.warning("approxbp: step %d peaked at %d bytes on %s, over the budget %d (planned %d): the plan "
                            "does not hold on this step (a longer batch, another loss path?); plan it at this "
                            "step's shape", state.global_step, peak, device, self.budget, planned)


def _cuda_device(model: nn.Module | None):
    """The CUDA device the model trains on, or None (the CPU: the tests count its steps with MemTracker)."""
    param = next(model.parameters(), None) if model is not None else None
    return param.device if param is not None and param.device.type == "cuda" else None


def _install_first_call(model: nn.Module, patch) -> None:
    """Set a ``forward`` on ``model`` (:class:`~approxbp.kernels.rewrite.bound_forward.BoundForward`) that waits
    for its first training call (training mode, grad enabled: an evaluation first, ``eval_on_start``, or a
    generation runs the model as it is): that call removes it, patches the model, then runs through the patched
    forward — the chunked loss and every move in force from step 1 (a forward pre-hook could not: the call has
    looked up its forward before the hooks run)."""
    now = model.__dict__.get("forward")
    if not (isinstance(now, BoundForward) and now.fn is _first_training_call):
        install_forward(model, _first_training_call, patch)


def _first_training_call(model: nn.Module, inner, patch, *args, **kwargs):
    # eagerly under torch.compile: dynamo would otherwise trace the patch's proofs and measurements
    return torch.compiler.disable(_patch_then_run)(model, inner, patch, *args, **kwargs)


def _patch_then_run(model: nn.Module, inner, patch, *args, **kwargs):
    if not (model.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    uninstall_forward(model, model.__dict__["forward"])
    patch(model, args, kwargs)
    return model.forward(*args, **kwargs)


class _ShapeWatch:
    """The planned input shape (batch, seq) of a budget; a training call past it warns once (the plan does not
    cover it: planned at the first batch and the longest sequence the data showed)."""

    def __init__(self, batch: int, seq: int | None):
        self.batch, self.seq, self.warned = batch, seq, False


def _watch_shape(model: nn.Module, batch: int, seq: int | None) -> None:
    install_forward(model, _watched_call, _ShapeWatch(batch, seq))


def _watched_call(model: nn.Module, inner, watch: _ShapeWatch, *args, **kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (not watch.warned and model.training and isinstance(ids, torch.Tensor) and ids.dim() == 2
            and (ids.shape[0] > watch.batch or (watch.seq is not None and ids.shape[1] > watch.seq))):
        watch.warned = True
        _logger.warning("approxbp: a training batch of %d × %d tokens, past the %d × %s the budget was planned at "
                        "(the first batch and the longest sequence the data showed): the budget is not promised "
                        "for it; plan at the largest shape (approxbp plan --batch --seq, then plan=)",
                        ids.shape[0], ids.shape[1], watch.batch, watch.seq)
    return inner(*args, **kwargs)


#: Why a budget is refused under TRL's fused LM head.
TRL_FUSED_HEAD = ("ApproxBPCallback(budget=…): this TRL trainer computes its loss with TRL's fused LM head "
                  "(model(..., fused_lm_head=True): its own chunked log-prob kernels, with workspaces the planner "
                  "does not trace), so the planned step is not the step that runs; a budget cannot be promised "
                  "here: pass family=/moves= (or plan= from approxbp plan, whose peak leaves TRL's loss out)")


def _trl_fused_head(model: nn.Module) -> bool:
    """Whether TRL's ``add_fused_lm_head`` set the model's forward (TRL ≥ 1.x: SFT, DPO, KTO, GRPO, RLOO), under
    whatever wraps it (accelerate's fp32 output wrapper keeps it as ``_original_forward`` and ``__wrapped__``)."""
    for fn in (model.__dict__.get("forward"), model.__dict__.get("_original_forward")):
        for _ in range(8):  # a few wrappers deep
            fn = getattr(fn, "__func__", fn)
            code = getattr(fn, "__code__", None)
            if code is None:
                break
            if "fused_lm_head" in code.co_varnames:
                return True
            fn = getattr(fn, "__wrapped__", None)
    return False


def _loss_reaches_model(args) -> bool:
    """Whether the trainer hands the labels to the model, so that a chunked loss computes the loss (Trainer's label
    smoother pops them and computes the loss from the logits itself)."""
    return not getattr(args, "label_smoothing_factor", 0)


def _refuse_unchunkable_loss(args, chunked: bool) -> None:
    if chunked and not _loss_reaches_model(args):
        raise ValueError(f"ApproxBPCallback: chunked_loss with label_smoothing_factor="
                         f"{args.label_smoothing_factor}: Trainer's label smoother calls the model without labels "
                         "and reads its logits, which the chunked loss never makes; drop chunked_loss (a budget "
                         "plans without it under label smoothing)")


#: Trainer's ``optim`` names → the planner's optimizers (the states it holds per parameter).
_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_apex_fused": "adamw",
               "adamw_bnb_8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit", "paged_adamw_32bit": "paged-adamw",
               "sgd": "sgd"}
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def trainer_setup(args, model: nn.Module):
    """The planner's :class:`~approxbp.planner.training.Setup` of what a trainer trains: the weights' dtype, bf16/fp16
    autocast (``args.bf16``/``args.fp16`` on float32 weights), peft's LoRA (rank, targets, dropout) or full training,
    the optimizer (``args.optim``), gradient accumulation (``args.gradient_accumulation_steps`` > 1: the gradients
    alive through each micro-batch), FSDP's sharding over ``args.world_size`` ranks (``args.fsdp``: each rank's peak
    is planned); anything else — DeepSpeed among it — is refused by name (pass ``setup=``)."""
    from approxbp.planner.training import Setup

    if getattr(args, "deepspeed", None):
        raise ValueError("ApproxBPCallback: cannot plan DeepSpeed's partitioning (planned: FSDP's, per rank): pass "
                         "setup=")
    shard = int(getattr(args, "world_size", 1)) if getattr(args, "fsdp", None) else 1

    dtype = next(_base(model).parameters()).dtype
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "adamw_torch")))
    if dtype not in _DTYPES or optim not in _OPTIMIZERS:
        raise ValueError(f"ApproxBPCallback: cannot plan for {dtype} weights with optim={optim!r} (planned: "
                         f"{', '.join(map(str, _DTYPES))}; {', '.join(_OPTIMIZERS)}): pass setup=")
    weights = _DTYPES[dtype]
    autocast = ("bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "off"
                ) if weights == "fp32" else "off"
    lora = {}
    config = _adapter_config(model)
    if config is not None:
        if type(config).__name__ != "LoraConfig":
            raise ValueError(f"ApproxBPCallback: cannot plan for a {type(config).__name__} adapter: pass setup=")
        targets = config.target_modules
        lora = {"train": "lora", "lora_dropout": config.lora_dropout,
                "lora_targets": targets if isinstance(targets, str) else tuple(sorted(targets))}
    accumulate = int(getattr(args, "gradient_accumulation_steps", 1) or 1) > 1
    return Setup(weights=weights, autocast=autocast, optimizer=_OPTIMIZERS[optim], shard=shard,
                 accumulate=accumulate, **lora)


def plan_for(model: nn.Module, example: dict, budget: int, *, gpu: str | None, setup, checkpoint: bool = False,
             chunked_loss: bool = True, longest: int | None = None, tables: tuple[str, ...] = ()):
    """The plan of ``model``'s config (fake tensors, ``approxbp plan``'s search) at the example's batch size and the
    run's longest sequence (``longest``, :func:`longest_sequence`; None: unknown, the example's length, said) under
    ``budget`` on ``gpu`` (``tables``: a user's table files offered to the search beside the packaged ones): its
    approximations, norms and moves (the fastest that fit; without the chunked loss when ``chunked_loss`` is False,
    as where the trainer computes the loss from the logits)."""
    import tempfile

    from approxbp.planner import plan as planner
    from approxbp.planner.request import Request

    base = _base(model)
    ids = example.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("ApproxBPCallback: planning from a budget reads the batch and sequence length off the first "
                         "batch's input_ids [batch, seq]; this batch has none: pass plan= instead")
    config = json.loads(base.config.to_json_string(use_diff=False))
    config["architectures"] = [type(base).__name__]  # the head the planner builds
    for setting in _AS_CONFIGURED:  # the model as it runs, not as its config JSON rebuilds it (those are dropped)
        if (value := getattr(base.config, f"_{setting}", None)) is not None:
            config[setting] = value
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config))
        if longest is None:
            _logger.warning("approxbp: the training data's longest sequence cannot be read (no sized dataset of "
                            "input_ids): the budget is planned at the first batch's %s tokens, and a longer batch "
                            "may exceed it; plan at the longest shape (approxbp plan, then plan=)", ids.shape[1])
        seq = max(ids.shape[1], longest or 0)
        request = Request(model=str(path), batch=ids.shape[0], seq=seq, setup=setup, checkpoint=checkpoint,
                          lora_r=getattr(_adapter_config(model), "r", 8), chunked_loss=chunked_loss,
                          tables=tuple(tables))
        return planner.plan(request, budget=budget, gpu=gpu or DEFAULT_GPU)


#: Datasets longer than this are not scanned for their longest sequence (planned at the first batch, said).
_SCAN_ROWS = 1_000_000


def longest_sequence(loader) -> int | None:
    """The most tokens a batch of ``loader`` can hold: its dataset's longest ``input_ids`` (rounded up to the
    collator's ``pad_to_multiple_of``; its ``max_length`` where it pads to it); None where it cannot be read (an
    iterable dataset, no ``input_ids``, more than :data:`_SCAN_ROWS` rows)."""
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if getattr(collate, "padding", None) == "max_length" and isinstance(getattr(collate, "max_length", None), int):
        return collate.max_length
    try:
        if not 0 < len(dataset) <= _SCAN_ROWS:
            return None
        if "input_ids" in (getattr(dataset, "column_names", None) or ()):
            rows = dataset["input_ids"]
        else:
            rows = (dataset[i]["input_ids"] for i in range(len(dataset)))
        longest = max(len(r) for r in rows)
    except (TypeError, KeyError, IndexError, AttributeError):
        return None
    multiple = getattr(collate, "pad_to_multiple_of", None)
    return -(-longest // multiple) * multiple if isinstance(multiple, int) and multiple > 0 else longest


#: The settings a model runs with that its config JSON leaves out: planned as the model runs (eager attention keeps
#: the attention matrix; fused or batched experts keep other tensors).
_AS_CONFIGURED = ("attn_implementation", "experts_implementation")


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _adapter_config(model: nn.Module):
    """The peft adapter's config (its first adapter), or None."""
    return next(iter(getattr(model, "peft_config", {}).values()), None)


def _keywords(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (positional ones bound to the forward's signature), labels included (TRL's
    fused-head forward needs them): the example input is the model's own first call."""
    signature = inspect.signature(model.forward)
    bound = signature.bind_partial(*args, **kwargs).arguments
    out = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif signature.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out
