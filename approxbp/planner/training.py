"""A training set-up, as orthogonal options: the planner's ``--mode`` names are presets of it.

weights (the stored dtype), autocast (the forward's compute dtype, or off), train (full, lora, lora-fa, none),
the LoRA targets and rank, the optimizer (its state bytes), torch.compile, sharding over N ranks (FSDP2 / ZeRO-3:
parameters, gradients and optimizer states split dim-0-wise over the ranks; activations are per rank), and the task
(the model's head and loss), and gradient accumulation (a micro-batch after the first runs its forward and backward
with every gradient alive: a traced step starts with them). LoRA adapters are laid out as peft lays them out by
default: fp32 adapters on a 16-bit base (peft's ``autocast_adapter_dtype``), the input cast to the adapter's dtype
and the sum cast back; ``adapters``
may name their dtype instead (QLoRA's reference script casts them to bf16). LoRA-FA (Zhang et al. 2023) freezes
the down-projection A at its initialisation, so only B trains and the layer keeps A·x (r values per token) in place
of x.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ADAPTERS", "add_lora", "as_setup", "AUTOCAST", "DTYPES", "HEADS", "held_by_module", "LORA_TARGETS",
           "LoRALinear", "nf4_bytes", "NF4Linear", "NORMS", "norms_in_fp32", "optimizer_bytes", "OPTIMIZERS",
           "per_rank", "PRESETS", "quantize_base", "quantized_weights", "Setup", "stored_bytes", "TRAIN", "WEIGHTS",
           "weights_for"]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Linear layers (or GPT-2's Conv1D) that get LoRA adapters by default (peft's defaults: attention query and value;
#: GPT-2's fused c_attn).
LORA_TARGETS = ("q_proj", "v_proj", "query", "value", "c_attn", "q", "v")
#: Output heads that peft's ``all-linear`` leaves alone.
HEADS = ("lm_head", "classifier", "score", "qa_outputs", "head", "output", "embed_out")
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw", "sgd")
TRAIN = ("full", "lora", "lora-fa", "none")
ADAPTERS = ("auto", "fp32", "bf16", "fp16")
NORMS = ("auto", "fp32")
#: --weights: a stored dtype, or nf4 (QLoRA's 4-bit frozen base); --autocast: the forward's autocast
WEIGHTS = (*DTYPES, "nf4")
AUTOCAST = ("off", "bf16", "fp16")
#: bitsandbytes' 8-bit AdamW: one byte per moment, and one fp32 absmax per block of this many values per moment.
_BNB_BLOCK = 256


@dataclass(frozen=True)
class Setup:
    """One training set-up (see the module docstring)."""

    weights: str = "bf16"
    autocast: str = "off"
    train: str = "full"
    lora_targets: tuple[str, ...] | str = LORA_TARGETS  # or "all-linear"
    optimizer: str = "adamw"
    compile: bool = False
    shard: int = 1
    adapters: str = "auto"  # the LoRA adapters' dtype; auto: peft's (fp32 on a 16-bit base)
    norms: str = "auto"  # the norms' weights: auto (the weights' dtype) or fp32 (QLoRA's script, peft's k-bit prep)
    task: str | None = None  # the head (approxbp.planner.tasks.TASKS); None: the config's architectures, else a default
    lora_dropout: float = 0.0  # peft's lora_dropout: the adapters read dropout(x) (a copy of x and its mask saved)
    devices: int = 1  # GPUs the model is split over by blocks (device_map="auto"): each one's peak, and their sum
    accumulate: bool = False  # gradient accumulation: the gradients alive through each micro-batch's forward

    def __post_init__(self):
        checks = (("weights", self.weights, WEIGHTS), ("autocast", self.autocast, AUTOCAST),
                  ("train", self.train, TRAIN), ("optimizer", self.optimizer, OPTIMIZERS),
                  ("adapters", self.adapters, ADAPTERS), ("norms", self.norms, NORMS))
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"--{name} {value!r}: expected one of {', '.join(allowed)}")
        if not (isinstance(self.lora_dropout, (int, float)) and 0 <= self.lora_dropout < 1):
            raise ValueError(f"--lora-dropout {self.lora_dropout!r}: expected a probability in [0, 1)")
        if not (isinstance(self.shard, int) and self.shard >= 1):
            raise ValueError(f"--shard {self.shard!r}: expected a positive number of ranks")
        if not (isinstance(self.devices, int) and self.devices >= 1):
            raise ValueError(f"--devices {self.devices!r}: expected a positive number of GPUs")
        if self.devices > 1 and (self.shard > 1 or self.compile):
            raise ValueError("--devices splits one model over GPUs by blocks: not with --shard or --compile")
        if self.weights == "nf4" and self.train == "full":
            raise ValueError("--weights nf4 stores the base Linears in 4 bits, which do not train: use --train lora "
                             "(QLoRA) or --train none")
        if self.task is not None:
            from approxbp.planner.tasks import TASKS

            if self.task not in TASKS:
                raise ValueError(f"--task {self.task!r}: expected one of {', '.join(TASKS)}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype modules are built in: nf4's base Linears compute in bf16 (QLoRA's compute dtype)."""
        return DTYPES.get(self.weights, torch.bfloat16)

    def describe(self, lora: tuple[str, ...] = (), head: str = "") -> str:
        """One line: the preset's name (``bf16``, ``lora``, …) or every option that differs from bf16; ``lora``: the
        Linears LoRA actually adapted (named instead of the candidate targets); ``head``: the head built and why."""
        targets = self.lora_targets if isinstance(self.lora_targets, str) else "/".join(self.lora_targets)
        adapted = "/".join(lora) + (" (all-linear)" if targets == "all-linear" else "") if lora else targets
        preset = next((name for name, p in PRESETS.items() if p == self), None)
        parts = [preset, *([f"LoRA on {adapted}"] if lora else [])] if preset else [
            f"{self.weights} weights", *([f"{self.autocast} autocast"] if self.autocast != "off" else []),
            {"full": "full training", "none": "no training"}.get(
                self.train, ("LoRA-FA" if self.train == "lora-fa" else "LoRA") + " on " + adapted),
            *([f"{self.adapters} adapters"] if self.adapters != "auto" else []),
            *([f"LoRA dropout {self.lora_dropout:g}"] if self.lora_dropout else []),
            *([f"{self.norms} norms"] if self.norms != "auto" else []),
            self.optimizer, *(["compiled"] if self.compile else []),
            *([f"sharded over {self.shard}"] if self.shard > 1 else []),
            *([f"split over {self.devices} GPUs by blocks"] if self.devices > 1 else []),
            *(["gradients accumulated"] if self.accumulate else [])]
        parts.append(f"head {head}" if head else f"task {self.task}" if self.task else "")
        return ", ".join(p for p in parts if p)


#: ``--mode`` presets: bf16 weights all trained; fp32 weights under bf16 autocast; frozen bf16 weights with LoRA on
#: the attention query/value projections; bf16 under torch.compile.
PRESETS = {"bf16": Setup(), "autocast": Setup(weights="fp32", autocast="bf16"), "lora": Setup(train="lora"),
           "compile": Setup(compile=True)}


def as_setup(mode: str | Setup) -> Setup:
    """A :class:`Setup`, or a preset's name."""
    if isinstance(mode, Setup):
        return mode
    if mode not in PRESETS:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[mode]


@contextlib.contextmanager
def weights_for(setup: str | Setup):
    """Within: new modules get the set-up's weight dtype (fake tensors cannot be converted after the fact)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(as_setup(setup).dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class LoRALinear(nn.Module):
    """y = base(x) + lora_B(lora_A(dropout(x)))·(2/r), laid out as peft lays it out (``base_layer``,
    ``lora_dropout``, ``lora_A``, ``lora_B``, so patch_model treats it as peft's; built here because peft's device
    moves cannot run on fake tensors): on a 16-bit base the adapters are fp32 (``dtype`` None), x is cast to the
    adapters' dtype and their sum cast back; ``dropout`` > 0 gives lora_A its own dropped copy of x to save."""

    def __init__(self, base: nn.Module, r: int, dtype: torch.dtype | None = None, dropout: float = 0.0):
        super().__init__()
        self.base_layer, self.scale = base, 2.0 / r
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        d_in, d_out = (base.in_features, base.out_features) if isinstance(base, nn.Linear) else base.weight.shape
        if dtype is None:
            dtype = torch.float32 if base.weight.dtype in (torch.bfloat16, torch.float16) else base.weight.dtype
        self.lora_A = nn.Linear(d_in, r, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(r, d_out, bias=False, dtype=dtype)

    def forward(self, x):
        y = self.base_layer(x)
        adapter = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype)))) * self.scale
        return (y + adapter).to(y.dtype)


class NF4Linear(nn.Linear):
    """A frozen base Linear as bitsandbytes' ``Linear4bit`` computes: its input cast to the compute dtype (the
    weight's, bf16), its output cast back to the input's dtype (so an fp32 input gives an fp32 output)."""

    def forward(self, x):
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def quantize_base(model: nn.Module) -> int:
    """Every frozen Linear but the output heads computes as bitsandbytes' 4-bit Linear (:class:`NF4Linear`); the
    number of them. Their storage is counted by :func:`quantized_weights`."""
    count = 0
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2]
        if type(m) is nn.Linear and not m.weight.requires_grad and leaf not in HEADS and not leaf.startswith("lora_"):
            m.__class__ = NF4Linear
            count += 1
    return count


def norms_in_fp32(model: nn.Module) -> int:
    """The parameters of every module whose name contains "norm" made fp32, as QLoRA's script does after peft's
    ``prepare_model_for_kbit_training``; the number of modules. A 16-bit hidden state times an fp32 weight is fp32,
    so the norms' outputs, and what reads them, become fp32."""
    count = 0
    for name, m in model.named_modules():
        if "norm" in name.rpartition(".")[2].lower():
            for pname, p in list(m.named_parameters(recurse=False)):
                setattr(m, pname, nn.Parameter(p.detach().float(), requires_grad=p.requires_grad))
            count += 1
    return count


def _adaptable(name: str, child: nn.Module, targets) -> bool:
    if not (isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D"):
        return False
    return name not in HEADS if targets == "all-linear" else name in targets


def add_lora(model: nn.Module, targets, r: int, dtype: torch.dtype | None = None, freeze_a: bool = False,
             dropout: float = 0.0) -> int:
    """Freeze ``model`` and put rank-``r`` adapters (of ``dtype``; None: peft's) on its Linears named in
    ``targets`` (or every Linear but the output head, ``all-linear``); ``freeze_a``: LoRA-FA, A frozen;
    ``dropout``: peft's lora_dropout. The number adapted."""
    model.requires_grad_(False)
    adapted = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _adaptable(name, child, targets):
                lora = LoRALinear(child, r, dtype, dropout)
                lora.lora_A.requires_grad_(not freeze_a)
                setattr(parent, name, lora)
                adapted += 1
    if not adapted:
        raise ValueError(f"--train lora: no Linear named {targets if isinstance(targets, str) else ', '.join(targets)}"
                         " to adapt, so nothing would train")
    return adapted


def optimizer_bytes(params: list[torch.Tensor], optimizer: str) -> int:
    """The optimizer's state for ``params``: AdamW two moments in the parameter dtype (as torch.optim.AdamW keeps
    them); bitsandbytes' paged AdamW (QLoRA's) two fp32 moments, in CUDA unified memory, counted as resident on the
    device; 8-bit AdamW one byte per moment plus an fp32 absmax per block of :data:`_BNB_BLOCK`; plain SGD none."""
    if optimizer == "sgd":
        return 0
    if optimizer == "adamw":
        return sum(2 * p.numel() * p.element_size() for p in params)
    if optimizer == "paged-adamw":
        return sum(8 * p.numel() for p in params)
    return sum(2 * (p.numel() + 4 * math.ceil(p.numel() / _BNB_BLOCK)) for p in params)


def nf4_bytes(numel: int) -> int:
    """One weight stored as QLoRA stores it (bitsandbytes' NF4 with double quantisation): 4 bits per value, one
    8-bit absmax per block of 64 values, one fp32 scale per block of 256 of those absmax values."""
    return math.ceil(numel / 2) + math.ceil(numel / 64) + 4 * math.ceil(numel / (64 * 256))


def quantized_weights(model: nn.Module, setup: Setup) -> set[int]:
    """ids of the weights stored in NF4 under ``--weights nf4``: those of :func:`quantize_base`'s Linears (every
    frozen Linear but the output heads and the adapters, as transformers' bitsandbytes integration quantises them:
    its default skips ``lm_head``)."""
    if setup.weights != "nf4":
        return set()
    return {id(m.weight) for m in model.modules() if isinstance(m, NF4Linear)}


def stored_bytes(params: list[torch.Tensor], quantized: set[int], shard: int) -> int:
    """Bytes of one rank's shard of ``params`` (those in ``quantized`` as NF4)."""
    return sum(nf4_bytes(q.numel()) if id(p) in quantized else q.numel() * q.element_size()
               for p, q in zip(params, per_rank(params, shard)))


def held_by_module(model: nn.Module, setup: Setup) -> dict[str, int]:
    """module path → bytes of the parameters it holds itself (stored as :func:`stored_bytes` stores them), with
    their gradients and optimizer states (one rank's shard); a tensor shared by modules is charged to the first."""
    quantized, seen, out = quantized_weights(model, setup), set(), {}
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        trained = [q for p, q in zip(own, per_rank(own, setup.shard)) if p.requires_grad]
        if own:
            out[name] = (stored_bytes(own, quantized, setup.shard) + sum(q.numel() * q.element_size() for q in trained)
                         + optimizer_bytes(trained, setup.optimizer))
    return out


def per_rank(params: list[torch.Tensor], ranks: int) -> list[torch.Tensor]:
    """Each parameter's shard on one of ``ranks`` ranks (dim 0 split, the last shard padded, as FSDP2 does), as
    meta tensors of that shape and dtype."""
    if ranks == 1:
        return params
    return [torch.empty((math.ceil(p.shape[0] / ranks), *p.shape[1:]) if p.dim() else (), dtype=p.dtype,
                        device="meta") for p in params]
