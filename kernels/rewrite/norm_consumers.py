"""Who reads each norm's output: torch.fx where the model traces, else one run of the example under a dispatch
mode that sees every op reading it (train and eval mode). One run stands for every input, whatever the model
branches on: the rewrite gives every reader the stock value on every path (a consumer that is handed anything but
the norm's own output computes as stock), so another path can only save less, never compute otherwise."""

from __future__ import annotations

import torch
from approxbp.kernels.ops.torch_private import TorchDispatchMode, pytree, storage_key
from torch import nn

from . import swaps
from .common import call, every_output, leaves, mode
from .fsdp import sharded_by_fsdp
from .norm_merge import has_proven_norm_form

__all__ = ["consumers_by_dispatch", "consumers_by_fx", "find_readers"]


#: How a norm's output read as a model output (a hidden state) is listed among its other readers.
_RETURNED = "returned as a model output"


def _watched(module: nn.Module) -> bool:
    """A norm to patch, or an MS-norm an earlier call made (whose new consumers may need wrapping)."""
    return has_proven_norm_form(module) or swaps.merged(module) is not None or swaps.kept_affine(module)


def _is_consumer(module: nn.Module) -> bool:
    """nn.Linear, or Hugging Face's Conv1D (GPT-2: a Linear with its weight stored transposed)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _shape_query(node) -> bool:
    """x.shape / x.size() / x.dim() read no values: they do not stop the memory sharing."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("shape", "dtype", "device")
    return node.op == "call_method" and node.target in ("size", "dim")


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer, with norms (whatever library defines them) and consumers kept as calls of their module.
    The leaves are chosen before tracing: while it traces, reading a module's parameter records a graph node."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.leaves = {id(m) for m in model.modules() if _watched(m) or _is_consumer(m)}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, qualname)


def consumers_by_fx(model: nn.Module) -> dict:
    """{norm name: (consumer names, other users)} from torch.fx.symbolic_trace, over every call site of every norm.
    A consumer that is also called on something else, or that reads two norms, is reported as another user: a
    rewrite of it would change those calls too."""
    graph = _LeafTracer(model).trace(model)
    modules = dict(model.named_modules())
    found: dict[str, tuple[list[str], set[str]]] = {}
    reads: dict[str, list] = {}  # consumer → the norm (or None) each of its call sites reads
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        if _is_consumer(modules[node.target]):
            src = node.args[0] if node.args else None
            norm = src.target if getattr(src, "op", None) == "call_module" and _watched(modules[src.target]) else None
            reads.setdefault(node.target, []).append(norm)
        if not _watched(modules[node.target]):
            continue
        linear, other = found.setdefault(node.target, ([], set()))
        for u in node.users:
            if _shape_query(u):
                continue
            if u.op == "call_module" and _is_consumer(modules[u.target]) and u.args and u.args[0] is node:
                if u.target not in linear:
                    linear.append(u.target)
            else:
                other.add(getattr(u.target, "__name__", str(u.target)))  # operator.add, torch.add: "add"
    _account_call_sites(found, reads)
    return found


def _account_call_sites(found: dict, reads: dict) -> None:
    """Mark as another user every consumer whose call sites do not all read the same norm."""
    for linear, other in found.values():
        for c in linear:
            sources = set(reads.get(c, []))
            if None in sources:
                other.add(f"{c} (also called on another input)")
            elif len(sources) > 1:
                other.add(f"{c} (reads {sorted(sources)})")


#: Ops that read a tensor's metadata, not its values (fake tensors answer ``.device`` through dispatch).
_METADATA = {torch.ops.prim.device, torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel,
             torch.ops.aten.sym_storage_offset, torch.ops.aten.is_contiguous}


def _whole_rows(t: torch.Tensor, out: torch.Tensor) -> bool:
    """``t`` (a view of the norm output ``out``) holds whole rows of ``out``, features in order: a reshape or a
    slice of rows, on which a Linear applies α, β along the right axis. A transposed or feature-sliced view is not."""
    if t.shape == out.shape and t.stride() == out.stride() and t.storage_offset() == out.storage_offset():
        return True
    d = out.shape[-1] if out.dim() else 0
    if not (out.is_contiguous() and t.dim() and t.shape[-1] == d and (t.stride(-1) == 1 or d == 1)):
        return False
    return (t.storage_offset() - out.storage_offset()) % max(d, 1) == 0 and all(
        s % max(d, 1) == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


class _ReadWatch(TorchDispatchMode):
    """Records, for each watched storage (a norm's output), the Linear modules whose ops read whole rows of it and
    any other (non-view) op; and, for each consumer's parameters, the ops that read them outside that consumer."""

    def __init__(self):
        super().__init__()
        self.owner: dict[int, tuple[str, torch.Tensor]] = {}  # storage pointer → (norm name, its output)
        self.inside: str | None = None  # the nn.Linear currently running
        self.running: list[str] = []  # the other leaf modules running now, innermost last (to name an op's place)
        self.found: dict[str, tuple[list[str], set[str]]] = {}
        self.keep: list[torch.Tensor] = []  # watched tensors stay alive, so that no storage pointer is reused
        self.read_now: set[str] = set()  # the norms the running consumer call has read
        self.reads: dict[str, list] = {}  # consumer → the norm (or None) each of its calls read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads_values = not func.is_view and func.overloadpacket not in _METADATA
        for t in pytree.tree_leaves((args, kwargs or {})):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = storage_key(t)
            if ptr not in self.owner:
                continue
            name, norm_out = self.owner[ptr]
            linear, other = self.found[name]
            if self.inside is not None:
                if reads_values and not _whole_rows(t, norm_out):
                    other.add(f"{self.inside} reads it through a transposed or feature-sliced view")
                    continue
                self.read_now.add(name)
                if self.inside not in linear:
                    linear.append(self.inside)
            elif func.overloadpacket is torch.ops.aten._to_copy and isinstance(out, torch.Tensor):
                self.watch(out, name)  # a dtype cast (peft's fp32 adapters): its readers read the norm's output too
            elif reads_values:
                op = str(func.overloadpacket.__name__)
                other.add(f"{op} in {self.running[-1]}" if self.running else op)
        return out

    def watch(self, t: torch.Tensor, name: str) -> None:
        self.keep.append(t)
        self.owner[storage_key(t)] = (name, t)
        self.found.setdefault(name, ([], set()))


def consumers_by_dispatch(model: nn.Module, example_input) -> dict:
    """{norm name: (consumer Linear names, other ops)} from the forward under :class:`_ReadWatch`, run in eval mode
    and in train mode (dropout between a norm and a Linear is visible only there), asking for every output
    (:func:`every_output`)."""
    watch, handles = _ReadWatch(), []

    def on_norm(name):
        def hook(module, inputs, out):
            watch.watch(out, name)
        return hook

    def enter(name):
        def hook(module, inputs):
            watch.inside = name
            watch.read_now = set()
        return hook

    def leave(name):
        def hook(module, inputs, out):
            watch.inside = None
            watch.reads.setdefault(name, []).extend(sorted(watch.read_now) or [None])
        return hook

    def push(name):
        return lambda module, inputs: watch.running.append(name)

    def pop(module, inputs, out):
        watch.running.pop()

    for name, m in model.named_modules():
        if _watched(m):
            handles.append(m.register_forward_hook(on_norm(name)))
        elif name and not _is_consumer(m) and next(m.children(), None) is None:  # a leaf: dropout, pooling, …
            handles.append(m.register_forward_pre_hook(push(name)))
            handles.append(m.register_forward_hook(pop, always_call=True))
        elif _is_consumer(m):
            handles.append(m.register_forward_pre_hook(enter(name)))
            handles.append(m.register_forward_hook(leave(name)))
    extra = every_output(model)
    try:
        for training in (False, True):
            with mode(model, training), watch:
                out = call(model, example_input, extra)
            for t in leaves(out):  # a norm output that is also returned (hidden states) must stay as it is
                name = watch.owner.get(storage_key(t)) if isinstance(t, torch.Tensor) else None
                if name is not None:
                    watch.found[name[0]][1].add(_RETURNED)
    finally:
        for h in handles:
            h.remove()
    _account_call_sites(watch.found, watch.reads)
    return watch.found


def find_readers(model: nn.Module, example_input) -> tuple[dict | None, str | None]:
    """({norm name: (consumer Linear names, other ops)}, None), or (None, why not): torch.fx where the model
    traces, else one run of ``example_input`` (:func:`consumers_by_dispatch`); a model FSDP2 shards is only run
    (tracing would run its hooks and make a block its root)."""
    if sharded_by_fsdp(model):
        why = "it is sharded by FSDP2 already"
    else:
        try:
            return consumers_by_fx(model), None
        except Exception as err:  # noqa: BLE001 - any tracing failure: fall back to running the model, or say why
            why = f"it is not fx-traceable ({type(err).__name__}: {str(err)[:80]})"
    if example_input is None:
        return None, why
    return consumers_by_dispatch(model, example_input), None  # (a branch on tensor values changes no reader's value)
