"""What the planner is asked: one training step (:class:`Request`: the model, its input size, the training set-up)
and the command line's spelling of it, which ``approxbp plan`` and the papers' memory rows share (:func:`parse`).

Building the parser imports no torch (``approxbp --help`` stays instant): the choices come from
:mod:`~.choices`, :mod:`~.gpus`, :mod:`~.tasks`; :meth:`Request.from_args` imports the set-up."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from approxbp.planner import choices as C
from approxbp.planner.gpus import GPUS
from approxbp.planner.tasks import TASKS

if TYPE_CHECKING:
    from approxbp.planner.training import Setup

__all__ = ["Request", "add_arguments", "compile_budgets", "parse", "setup_of"]


@dataclass(frozen=True, kw_only=True)
class Request:
    """One training step: ``model`` (a config file, a bundled hub id or a model type with overrides, or
    ``module:package.module:factory``; :func:`approxbp.planner.models.model_spec`), ``batch`` × ``seq`` inputs, the
    ``setup`` (:class:`~approxbp.planner.training.Setup` or a preset's name), the LoRA rank, activation
    ``checkpoint``-ing, ``traced`` (a whole step traced by MemTracker; default: with checkpointing), ``fake``
    (fake tensors; False: real ones, for the tests that compare) and ``chunked_loss`` (False: not a move, as where
    the trainer computes the loss from the logits itself)."""

    model: str
    batch: int = 1
    seq: int = 512
    setup: Setup | str = "bf16"  # a preset's name becomes its Setup
    lora_r: int = 8
    checkpoint: bool = False
    traced: bool | None = None
    fake: bool = True
    chunked_loss: bool = True  # whether the loss may be chunked (False: the trainer computes it from the logits)
    tables: tuple[str, ...] = ()  # a user's table files, each an option of its activation (--table)

    def __post_init__(self):
        from approxbp.planner.training import as_setup

        object.__setattr__(self, "setup", as_setup(self.setup))
        for name in ("batch", "seq", "lora_r"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

    def at(self, *, batch: int | None = None, seq: int | None = None) -> Request:
        """The same step at another batch or sequence length."""
        return replace(self, batch=self.batch if batch is None else batch, seq=self.seq if seq is None else seq)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Request:
        """The step a parsed ``approxbp plan`` command line describes (:func:`add_arguments`)."""
        return cls(model=args.model, batch=args.batch, seq=args.seq, setup=setup_of(args), lora_r=args.lora_r,
                   checkpoint=args.checkpoint, traced=args.trace or None, tables=tuple(args.table or ()))


#: The set-up options, each overriding --mode's preset (Setup's fields of the same names).
_SETUP_OPTIONS = ("weights", "autocast", "train", "optimizer", "shard", "adapters", "norms", "task", "lora_dropout",
                 "devices", "accumulate")


def setup_of(args: argparse.Namespace) -> Setup:
    """--mode's preset with every set-up option given on the command line in place of its own."""
    from approxbp.planner.training import PRESETS

    changes = {k: getattr(args, k) for k in _SETUP_OPTIONS if getattr(args, k) is not None}
    if args.lora_targets:
        changes["lora_targets"] = args.lora_targets if args.lora_targets == "all-linear" else tuple(
            t.strip() for t in args.lora_targets.split(",") if t.strip())
    if args.compile:
        changes["compile"] = True
    return replace(PRESETS[args.mode], **changes)


def compile_budgets(text: str | None) -> tuple[float, ...]:
    """``--compile-budgets 1,0.4,0``: the fractions, each in [0, 1] (refused in one line otherwise)."""
    if text is None:
        return ()
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"--compile-budgets {text}: expected comma-separated fractions in [0, 1], e.g. 1,0.4,0")
    return values


def parse(argv: list[str]) -> argparse.Namespace:
    """``approxbp plan ARGV``'s planner arguments (:func:`add_arguments`), e.g. a paper row's command; the
    request is ``Request.from_args`` of the result."""
    parser = argparse.ArgumentParser(prog="approxbp plan")
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(pln) -> None:
    """The step (:class:`Request`) and what to do with it: --budget, --gpu, --pareto, --compile-budgets,
    --maximize, --grain, --use."""
    pln.add_argument("model", help="a Hugging Face config JSON file, the hub id of a config shipped with approxbp "
                     "(the papers' models: google/vit-base-patch16-224-in21k, huggyllama/llama-7b, …), or a model "
                     "type, each optionally with :key=value,… overrides "
                     "(llama:hidden=4096,layers=32,heads=32,intermediate=11008,vocab=32000); or "
                     "module:package.module:factory")
    pln.add_argument("--batch", type=int, default=1, help="batch size")
    pln.add_argument("--seq", type=int, default=512, help="sequence length (text models)")
    pln.add_argument("--mode", default="bf16", choices=C.PRESETS,
                     help="bf16 weights; fp32 weights under bf16 autocast; frozen bf16 weights with LoRA adapters; "
                     "bf16 under torch.compile (inductor's partitioner)")
    pln.add_argument("--checkpoint", action="store_true", help="activation checkpointing on top of --mode (each "
                     "block recomputed in backward; the whole step is traced by PyTorch's MemTracker)")
    pln.add_argument("--trace", action="store_true", help="trace a whole step (forward, backward, AdamW) with "
                     "MemTracker for the true peak and its moment, rather than the forward's saved tensors (the "
                     "default of a plan without --budget, --use, --maximize or --pareto, where the step can be traced)")
    pln.add_argument("--modelled", action="store_true", help="without --budget: the modelled end of the forward "
                     "only, not the traced step (faster; the step's peak can be well above it)")
    pln.add_argument("--lora-r", type=int, default=8, help="LoRA rank (with --train lora or --mode lora)")
    _setup_arguments(pln)
    pln.add_argument("--budget", default=None, help="peak memory to fit, e.g. 24GiB (none: save the most)")
    pln.add_argument("--gpu", choices=list(GPUS), default=None, help="beyond the approximations, recompute and "
                     "offload blocks at the least modelled step time on this GPU (a roofline; planner/gpus.py); "
                     "--budget without it weighs the moves on h100 and says so")
    pln.add_argument("--pareto", type=int, default=None, metavar="N",
                     help="with --gpu: the curve of modelled peak vs step time vs gradient-error bound over budgets, N "
                          "points on each stretch (approximations, then moves); --out writes it as JSON, --figure "
                          "plots it")
    pln.add_argument("--compile-budgets", nargs="?", const="1,0.6,0.4,0.2,0.1,0", default=None, metavar="B,…",
                     help="with --gpu and --budget or --pareto: also weigh each assignment under torch.compile at "
                          "these activation_memory_budget values (default 1,0.6,0.4,0.2,0.1,0), the fastest plan "
                          "wins (planner/compiled.py)")
    pln.add_argument("--maximize", choices=C.MAXIMIZE, default=None,
                     help="find the largest batch or sequence length that fits --budget (the plan is for it)")
    pln.add_argument("--grain", type=int, default=64, help="--maximize seq_len searches multiples of this many tokens")
    pln.add_argument("--table", action="append", default=None, metavar="TABLE.json",
                     help="repeatable: a table of your own (fit relu-sum/invact --out) offered to the search as one "
                     "more option for the layers of its activation, beside the packaged ones")
    pln.add_argument("--use", default=None, help="evaluate this assignment instead of choosing one: exact, "
                     "relu-sum-k1…k4 or invact for every activation layer, or a table file of your own (fit "
                     "relu-sum/invact --out: every layer of its activation), each optionally +ms-norm (or "
                     "ms-norm alone), or a plan JSON (--out of an earlier plan); with --maximize, the largest size "
                     "it fits")


def _setup_arguments(pln) -> None:
    """The set-up options, each overriding --mode's preset."""
    setup = pln.add_argument_group("the set-up, option by option (each overrides --mode's preset)")
    setup.add_argument("--weights", choices=C.WEIGHTS, default=None,
                       help="stored weight dtype; nf4: the frozen base Linears in QLoRA's 4-bit NF4 with double-"
                            "quantised absmax, computing in bf16")
    setup.add_argument("--autocast", choices=C.AUTOCAST, default=None, help="the forward's autocast")
    setup.add_argument("--train", choices=C.TRAIN, default=None,
                       help="what trains: every parameter, LoRA adapters on a frozen base (peft's layout: fp32 "
                            "adapters on a 16-bit base), LoRA-FA (A frozen: only B trains), or nothing")
    setup.add_argument("--adapters", choices=C.ADAPTERS, default=None,
                       help="the LoRA adapters' dtype (auto: peft's "
                       "default, fp32 on a 16-bit base; QLoRA's script casts them to bf16)")
    setup.add_argument("--norms", choices=C.NORMS, default=None, help="the norms' weights: the weights' "
                       "dtype, or fp32 as QLoRA's script keeps them (a 16-bit input times them is fp32)")
    setup.add_argument("--task", choices=tuple(TASKS), default=None, help="the head and its loss (default: the "
                       "config's architectures, else causal-lm, or image-cls for a vision config)")
    setup.add_argument("--lora-targets", default=None, help="comma-separated Linear names, or all-linear (every "
                       "Linear but the output head); default: the attention query and value")
    setup.add_argument("--lora-dropout", type=float, default=None, help="peft's lora_dropout: each adapter saves "
                       "its own dropped copy of its input and a 1-byte mask (default 0: none)")
    setup.add_argument("--optimizer", choices=C.OPTIMIZERS, default=None,
                       help="its state: AdamW's two moments (the parameters' dtype), bitsandbytes' 8-bit moments, "
                       "its paged AdamW's fp32 moments (QLoRA's; counted as resident), or none (plain SGD)")
    setup.add_argument("--devices", type=int, default=None, help="GPUs the model is split over by blocks, as "
                       "Hugging Face's device_map=\"auto\" does: each GPU's peak and their sum (not with --budget)")
    setup.add_argument("--compile", action="store_true", help="torch.compile (inductor's partitioner)")
    setup.add_argument("--accumulate", action="store_true", default=None, help="gradient accumulation: every "
                       "gradient alive through a micro-batch's forward and backward (the traced step starts with them)")
    setup.add_argument("--shard", type=int, default=None, help="ranks that shard parameters, gradients and "
                       "optimizer states (FSDP2 / ZeRO-3); activations are per rank")
