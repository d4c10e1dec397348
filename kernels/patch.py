"""patch_model: swap activations for their memory-saving versions and merge norms into their consumers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .invact import InvActGELU, InvActSiLU
from .norms import is_mergeable_norm, merge_norm
from .relu_sum import ReGELU2, ReSiLU2

_GELU_NAMES = {"GELU", "GELUActivation"}  # torch and Hugging Face transformers
_SILU_NAMES = {"SiLU", "SiLUActivation"}
ACTIVATIONS = ("relu-sum", "invact", None)


@dataclass
class PatchReport:
    activations: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"swapped {len(self.activations)} activations, merged {len(self.norms)} norms"
                + (f"; skipped: {'; '.join(self.skipped)}" if self.skipped else ""))


def _replacement(module: nn.Module, activation: str):
    name = type(module).__name__
    if name in _GELU_NAMES and getattr(module, "approximate", "none") == "none":
        return ReGELU2() if activation == "relu-sum" else InvActGELU()
    if name in _SILU_NAMES:
        return ReSiLU2() if activation == "relu-sum" else InvActSiLU()
    return None


def patch_model(model: nn.Module, activation: str | None = "relu-sum", norm: bool = True,
                example_input=None) -> PatchReport:
    """In place: replace nn.GELU/nn.SiLU (and HF GELUActivation/SiLUActivation) by ReGELU2/ReSiLU2
    (``activation='relu-sum'``) or InvActGELU/InvActSiLU (``'invact'``); with ``norm=True`` merge every
    LayerNorm/RMSNorm whose outputs feed only Linear layers into them (eq. 58) and replace it by its
    MS-norm. Consumers are found with torch.fx; models fx cannot trace (e.g. Hugging Face ones) need an
    ``example_input`` (a tensor, a tuple of positional arguments or a dict of keyword arguments): one
    forward is run under a dispatch mode that sees every op reading each norm's output. A norm that feeds
    anything but Linear layers (views aside) is left alone and listed in the report's ``skipped``; so is a
    norm over several trailing dimensions, and one whose consumer's weight is shared with another module (tied
    embeddings), since merging would change that module too. Patching is all or nothing: on any error every
    change made so far is undone before the error propagates."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    report, undo = PatchReport(), _Undo()
    try:
        if norm:
            _merge_norms(model, report, undo, example_input)
        if activation:
            for parent_name, parent in list(model.named_modules()):
                for child_name, child in list(parent.named_children()):
                    new = _replacement(child, activation)
                    if new is not None:
                        undo.setattr(parent, child_name, new)
                        report.activations.append(f"{parent_name + '.' if parent_name else ''}{child_name}: "
                                                  f"{type(child).__name__} → {type(new).__name__}")
    except BaseException:
        undo.rollback()
        raise
    return report


class _Undo:
    """The changes patch_model made, in order, so that a failure can restore the model exactly."""

    def __init__(self):
        self.steps: list = []

    def setattr(self, parent: nn.Module, name: str, new: nn.Module) -> None:
        old = getattr(parent, name)
        self.steps.append(lambda: setattr(parent, name, old))
        setattr(parent, name, new)

    def keep_linear(self, lin: nn.Linear) -> None:
        weight, bias = lin.weight.detach().clone(), lin.bias
        bias_value = None if bias is None else bias.detach().clone()

        @torch.no_grad()
        def restore():
            lin.weight.copy_(weight)
            if bias is None:
                lin.bias = None
            else:
                lin.bias = bias
                bias.copy_(bias_value)

        self.steps.append(restore)

    def rollback(self) -> None:
        for step in reversed(self.steps):
            step()
        self.steps.clear()


def _shared_parameters(model: nn.Module) -> set[int]:
    """Storage pointers of parameters reachable under more than one name (tied weights)."""
    names: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        ptr = p.untyped_storage().data_ptr()
        names[ptr] = names.get(ptr, 0) + 1
    return {ptr for ptr, n in names.items() if n > 1}


def _shape_query(node) -> bool:
    """x.shape / x.size() / x.dim() read no values: they do not stop the memory sharing."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("shape", "dtype", "device")
    return node.op == "call_method" and node.target in ("size", "dim")


def _merge_norms(model: nn.Module, report: PatchReport, undo: _Undo, example_input=None) -> None:
    try:
        found = _consumers_by_fx(model)
    except Exception as err:  # noqa: BLE001 - any tracing failure: fall back to running the model, or say why
        if example_input is None:
            report.skipped.append(f"norm merging: model is not fx-traceable ({type(err).__name__}: "
                                  f"{str(err)[:80]}); pass example_input to find consumers by running it")
            return
        found = _consumers_by_dispatch(model, example_input)
    modules = dict(model.named_modules())
    shared = _shared_parameters(model)
    for name, (consumers, other) in found.items():
        if other or not consumers:
            report.skipped.append(f"{name}: output feeds something other than Linear layers"
                                  + (f" ({', '.join(sorted(other))})" if other else ""))
            continue
        shape = getattr(modules[name], "normalized_shape", (None,))
        if isinstance(shape, tuple | list) and len(shape) != 1:
            report.skipped.append(f"{name}: normalises over {tuple(shape)}, not the last dimension alone")
            continue
        tied = [c for c in consumers if any(p.untyped_storage().data_ptr() in shared
                                            for p in modules[c].parameters(recurse=False))]
        if tied:
            report.skipped.append(f"{name}: consumer(s) {tied} share their weight with another module (tied "
                                  "weights); merging would change that module too")
            continue
        for c in consumers:
            undo.keep_linear(modules[c])
        ms = merge_norm(modules[name], [modules[c] for c in consumers])
        parent_name, _, child = name.rpartition(".")
        undo.setattr(modules[parent_name] if parent_name else model, child, ms)
        report.norms.append(f"{name} → {type(ms).__name__} merged into {consumers}")


def _consumers_by_fx(model: nn.Module) -> dict[str, tuple[list[str], set[str]]]:
    """{norm name: (consumer Linear names, other users)} from torch.fx.symbolic_trace."""
    graph = torch.fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    found = {}
    for node in graph.nodes:
        if node.op != "call_module" or not is_mergeable_norm(modules[node.target]):
            continue
        users = [u for u in node.users if not _shape_query(u)]
        linear = [u.target for u in users if u.op == "call_module" and isinstance(modules[u.target], nn.Linear)]
        found[node.target] = (linear, {str(u.target) for u in users if u.target not in linear})
    return found


class _ReadWatch(TorchDispatchMode):
    """Records, for each watched storage, the Linear modules whose ops read it and any other (non-view) op."""

    def __init__(self):
        super().__init__()
        self.owner: dict[int, str] = {}  # storage pointer → norm name
        self.inside: str | None = None  # the nn.Linear currently running
        self.found: dict[str, tuple[list[str], set[str]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in pytree.tree_leaves((args, kwargs or {})):
            name = self.owner.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None
            if name is None:
                continue
            linear, other = self.found[name]
            if self.inside is not None:
                if self.inside not in linear:
                    linear.append(self.inside)
            elif not func.is_view:
                other.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _consumers_by_dispatch(model: nn.Module, example_input) -> dict[str, tuple[list[str], set[str]]]:
    """{norm name: (consumer Linear names, other ops)} from one forward under :class:`_ReadWatch`."""
    watch, keep, handles = _ReadWatch(), [], []

    def on_norm(name):
        def hook(module, inputs, out):
            keep.append(out)  # alive until the end, so its storage pointer is not reused
            watch.owner[out.untyped_storage().data_ptr()] = name
            watch.found.setdefault(name, ([], set()))
        return hook

    def enter(name):
        return lambda module, inputs: setattr(watch, "inside", name)

    for name, m in model.named_modules():
        if is_mergeable_norm(m):
            handles.append(m.register_forward_hook(on_norm(name)))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_pre_hook(enter(name)))
            handles.append(m.register_forward_hook(lambda *a: setattr(watch, "inside", None)))
    try:
        with torch.no_grad(), watch:
            if isinstance(example_input, dict):
                model(**example_input)
            elif isinstance(example_input, tuple | list):
                model(*example_input)
            else:
                model(example_input)
    finally:
        for h in handles:
            h.remove()
    return watch.found
