"""What every rewrite of :func:`~.patch.patch_model` shares: the report, the undo log, running the example (every
output, train and eval mode, seeded dropout) and the saved-bytes check that undoes a group of rewrites that saves
nothing."""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from approxbp.approximations import tables as table_files
from torch import nn

from ..ops.saved import charged
from ..ops.torch_private import MODULE_HOOK_TABLES, pytree
from .fsdp import share_with_fsdp

__all__ = ["by_pattern", "call", "every_output", "FILTERED", "hooks_of", "leaves", "MAX_BITS", "mode", "move_hooks",
           "output_difference", "PatchConfig", "PatchReport", "path_pattern", "replace", "run_example",
           "RewriteGuard", "saved_on_example", "Undo"]


#: How a module ``module_filter_fn`` refused is listed in the report's ``skipped``.
FILTERED = "left out by module_filter_fn"
#: The largest ``bits`` with packaged ReLU-sum tables (k = 1…8).
MAX_BITS = 8


@dataclass(frozen=True)
class PatchConfig:
    """What :func:`~.patch.patch_model` rewrites (keyword arguments of the same names build one).

    ``family``: ``"relu-sum"`` (each activation's k = ``bits`` primitive ReLU-sum table), ``"invact"`` (its fast
    InvAct table) or None (activations are not swapped, unless ``tables`` names them). An activation with an exact
    table (ReLU², softplus) gets it in either family.
    ``tables``: one table path for every recognised activation, or a mapping {module class, class name or module
    path: table path, table, drop-in module or ``"exact"``}; a module the mapping does not name gets the family's.
    ``norms``: make LayerNorms/RMSNorms MS-norms where their readers allow it (eq. 58).
    ``glu``: fuse gated MLPs into the exact op (needs an example input): True, or the module paths to fuse.
    ``module_filter_fn(module, fqn)``: False leaves that activation, norm or gated MLP as it is (reported)."""

    family: str | None = "relu-sum"
    tables: str | Path | Mapping | None = None
    norms: bool = True
    glu: bool | Collection[str] = True
    bits: int = 2
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None

    def __post_init__(self):
        from ..ops.modules import drop_in_families  # the families registered with a drop-in (family=None: no swap)

        if self.family not in (*drop_in_families(), None):
            raise ValueError(f"family must be one of {(*drop_in_families(), None)}, got {self.family!r}")
        if not (self.tables is None or isinstance(self.tables, Mapping) or _is_table(self.tables)):
            raise ValueError(f"tables must be a table path, a packaged table name or a mapping, got {self.tables!r}")
        if isinstance(self.tables, Mapping):
            for key, value in self.tables.items():
                if isinstance(value, str | Path) and value != "exact" and not _is_table(value):
                    raise ValueError(f"tables[{key!r}] = {str(value)!r}: no such table file or packaged table (or "
                                     "\"exact\")")
        if not isinstance(self.norms, bool):
            raise TypeError(f"norms must be True or False, got {self.norms!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be an integer from 1 to {MAX_BITS} (the packaged ReLU-sum tables), got "
                             f"{self.bits!r}")
        if isinstance(self.glu, str | bytes) or not (isinstance(self.glu, bool) or (
                isinstance(self.glu, Collection) and all(isinstance(p, str) for p in self.glu))):
            raise TypeError(f"glu must be True, False or a collection of module paths, got {self.glu!r} (a single "
                            "path goes in a list: glu=[path])")

    def wants(self, module: nn.Module, fqn: str) -> bool:
        """Whether ``module_filter_fn`` lets the rewrite of ``module`` (at path ``fqn``) happen."""
        return self.module_filter_fn is None or bool(self.module_filter_fn(module, fqn))


def _is_table(value) -> bool:
    """Whether ``value`` names a table file (a path or a packaged name)."""
    try:
        return isinstance(value, str | Path) and table_files.resolve(value).is_file()
    except FileNotFoundError:
        return False


@dataclass
class PatchReport:
    activations: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    max_output_difference: float | None = None
    glus: list[str] = field(default_factory=list)
    #: Bytes saved for backward by one training forward on the example (stock, patched); None: not measured.
    saved_bytes: tuple[int, int] | None = None
    #: Blocks recomputed or offloaded by a plan's moves (``Plan.apply``; ``~.moves.remove_moves`` undoes them).
    moves: list[str] = field(default_factory=list)

    @staticmethod
    def subject(line: str) -> str:
        """The module path a line of ``activations``, ``norms`` or ``glus`` is about (its first word)."""
        return re.match(r"[^\s:]*", line)[0]

    def rewritten(self) -> set[str]:
        """The module paths this patch rewrote: activations swapped, norms made MS-norms, gated MLPs fused."""
        return {self.subject(line) for line in (*self.activations, *self.norms, *self.glus)}

    def __str__(self) -> str:
        diff = ("" if self.max_output_difference is None
                else f"; max |output difference| on the example {self.max_output_difference:.3g}")
        glus = f", fused {len(self.glus)} gated MLPs (exact)" if self.glus else ""
        if self.saved_bytes is not None:
            before, after = self.saved_bytes
            diff += (f"; saved for backward on the example: {before:,} → {after:,} bytes "
                     f"({100 * (after - before) / max(before, 1):+.1f} %)")
        moves = f", moved {len(self.moves)} blocks ({'; '.join(self.moves)})" if self.moves else ""
        return (f"swapped {len(self.activations)} activations, made {len(self.norms)} norms MS-norms{glus}{moves}{diff}"
                + (f"; skipped: {'; '.join(self.skipped)}" if self.skipped else ""))


def path_pattern(name: str) -> str:
    """A module path with its layer indices as ``*``: the rewrites of one pattern are measured together."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def by_pattern(items: list, name=lambda item: item) -> list[tuple[str, list]]:
    """``items`` grouped by the :func:`path_pattern` of their module path, patterns in order of first appearance."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(path_pattern(name(item)), []).append(item)
    return list(groups.items())


def saved_on_example(model: nn.Module, example_input) -> int | None:
    """Bytes of distinct storages saved for backward by one train-mode forward on the example (parameters, which
    exist anyway, not counted); None when nothing in the model requires grad (nothing would be saved)."""
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        return None
    into: dict[str, int] = {}
    share_with_fsdp(model)
    with mode(model, True, grad=True), charged(into, exclude=params):
        call(model, example_input)
    return sum(into.values())


class RewriteGuard:
    """Never a loss, never a changed value: after each group of rewrites (one pattern of module paths) the example
    is run and every output compared with the stock model's (``stock``, :func:`run_example`); a group that changes
    one is undone and retried one module at a time, and each module that changes an output alone is undone and
    listed in ``skipped`` (the rest stay rewritten). Then the bytes saved for backward are measured; a group after
    which they did not drop is undone and listed too."""

    def __init__(self, model: nn.Module, example_input, report: PatchReport, undo: Undo, measure: bool,
                 stock: list | None = None):
        self.model, self.example, self.report, self.undo, self.stock = model, example_input, report, undo, stock
        self.bytes = saved_on_example(model, example_input) if measure and example_input is not None else None
        self.before = self.bytes

    def _marks(self) -> tuple[int, ...]:
        r = self.report
        return len(self.undo.steps), len(r.norms), len(r.glus), len(r.activations), len(r.skipped)

    def _undo_to(self, marks: tuple[int, ...], keep_skipped: bool = False) -> list[str]:
        """Undo everything after ``marks`` (the reasons given for skips too, unless ``keep_skipped``); the module
        paths whose rewrites were undone."""
        r = self.report
        lists = (r.norms, r.glus, r.activations) + (() if keep_skipped else (r.skipped,))
        done = [r.subject(line) for kept, mark in zip(lists[:3], marks[1:4]) for line in kept[mark:]]
        self.undo.rollback(marks[0])
        for kept, mark in zip(lists, marks[1:]):
            del kept[mark:]
        return done

    def _changed(self) -> str | None:
        """How the model's outputs on the example differ from the stock ones (None: within tolerance)."""
        if self.stock is None:
            return None
        return output_difference(self.stock, run_example(self.model, self.example))[1]

    def _fault(self) -> str | None:
        """Why the model as rewritten now cannot stay (None: it can): an output changed on the example, or the
        example fails with it — e.g. an in-place writer (``h.mul_``, ``+=``, ``dropout(inplace=True)``) after a
        swapped activation, which autograd refuses on a custom Function's output only in a training forward. That
        forward is the saved-bytes measurement, kept for :meth:`_keep_if_saving`."""
        try:
            if (why := self._changed()) is not None:
                return f"it changed {why} on the example"
            if self.bytes is not None:
                self._measured = (self._marks(), saved_on_example(self.model, self.example))
        except Exception as err:  # noqa: BLE001 — any failure of the rewritten model is a reason to keep the stock one
            if "modified inplace" in str(err):
                return ("its output is written in place after it (h.mul_, +=, clamp_, dropout(inplace=True)), which "
                        "autograd refuses on a custom Function's output in a training forward")
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return f"the example fails with it ({type(err).__name__}: {first[:200]})"
        return None

    def attempts(self, what: str, items: list, name=lambda item: item):
        """Yields the items of one group to rewrite: all together, and again one at a time if together they change
        an output or fail (:meth:`_fault`); a module that does so alone is undone and skipped with the reason,
        never the whole call (:class:`RewriteGuard`). The caller rewrites each item it is given."""
        marks = self._marks()
        yield items
        if len(self.undo.steps) > marks[0] and self._fault():
            self._undo_to(marks)
            for item in items:
                mine = self._marks()
                yield [item]
                if len(self.undo.steps) > mine[0] and (why := self._fault()):
                    self._undo_to(mine)
                    self.report.skipped.append(f"{name(item)}: rewritten, {why}; kept as it was")
        self._keep_if_saving(what, marks)

    def _keep_if_saving(self, what: str, marks: tuple[int, ...]) -> None:
        if self.bytes is None or len(self.undo.steps) == marks[0]:
            return
        measured = getattr(self, "_measured", None)
        now = measured[1] if measured and measured[0] == self._marks() else saved_on_example(self.model, self.example)
        if now < self.bytes:
            self.bytes = now
            return
        done = self._undo_to(marks, keep_skipped=True)
        self.report.skipped.append(f"{what}: saves nothing here (with it, one training forward on the example saves "
                                   f"{now - self.bytes:+,} bytes more for backward); kept as it was: {', '.join(done)}")

    def close(self) -> None:
        if self.before is not None:
            self.report.saved_bytes = (self.before, self.bytes)
        elif self.bytes is None and self.example is not None:
            self.report.skipped.append("saved bytes: not measured, nothing in the model requires grad on the example")


def output_difference(before: list, after: list) -> tuple[float, str | None]:
    """(the largest difference between two :func:`run_example` results, what exceeds the dtype-aware tolerance
    (fp64 1e-6, fp32 1e-3, 16-bit 5e-2, times max(1, max|output|)) or a changed structure, or None). Non-finite
    entries are compared as themselves: NaN where stock has NaN, the same infinity where it has one (NaN − NaN is
    not a change); the tolerance reads the finite ones."""
    if len(after) != len(before) or any(a.shape != b.shape for a, b in zip(after, before)):
        return float("inf"), "the structure of the model's outputs"
    largest = 0.0
    for i, (a, b) in enumerate(zip(after, before)):  # every floating output: logits, hidden states, …
        a, b = a.double(), b.double()
        finite = torch.isfinite(b)
        alike = torch.where(finite, torch.isfinite(a), (a == b) | (a.isnan() & b.isnan()))
        if not bool(alike.all()):
            return float("inf"), (f"output {i} of the model: {int((~alike).sum())} entries non-finite where stock's "
                                  "are finite, or otherwise non-finite than stock's")
        a, b = a[finite], b[finite]
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        largest = max(largest, diff)
        tol = {torch.float64: 1e-6, torch.float32: 1e-3}.get(before[i].dtype, 5e-2)
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        if not diff <= tol * scale:
            return largest, f"output {i} of the model by {diff:.3g} > {tol:g}·{scale:.3g}"
    return largest, None


def call(fn, example_input, extra: dict | None = None):
    """``fn`` on ``example_input``: keyword arguments (a dict), positional ones (a tuple or list) or one tensor;
    ``extra`` keyword arguments are added (they win over the example's own)."""
    extra = extra or {}
    if isinstance(example_input, dict):
        return fn(**{**example_input, **extra})
    args = tuple(example_input) if isinstance(example_input, tuple | list) else (example_input,)
    return fn(*args, **extra)


def every_output(model: nn.Module) -> dict:
    """The keyword arguments that make ``model`` return every output it can: ``output_hidden_states=True`` where
    its forward takes it (by name, or through ``**kwargs`` on a Hugging Face model, whose config has the flag). A
    rewrite is proven on these outputs too: hidden states are read by embeddings, reward heads and distillation."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    takes = "output_hidden_states" in params or (
        any(p.kind is p.VAR_KEYWORD for p in params.values())
        and hasattr(getattr(model, "config", None), "output_hidden_states"))
    return {"output_hidden_states": True} if takes else {}


def leaves(out) -> list:
    """The tensors and other leaves of a model output (tuples, dicts, ``ModelOutput`` fields)."""
    return pytree.tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)


#: The seed both runs of the train-mode check draw their dropout masks from.
_TRAIN_SEED = 0


@contextlib.contextmanager
def mode(model: nn.Module, training: bool, grad: bool = False):
    """Within: ``model`` in train or eval mode, without grad (``grad=True``: with), torch's, numpy's and Python's
    RNGs seeded with :data:`_TRAIN_SEED` (wav2vec2-style models draw their time masks from numpy); on leaving, the
    RNG states, every module's mode and every buffer (BatchNorm's running statistics) are restored, and the hooks
    and instance attributes the run added are removed (transformers installs output-capturing forward hooks on the
    first ``output_hidden_states=True`` call; kept, they would break a compiled model's graphs), so that a probe
    run changes nothing the model keeps."""
    import random

    import numpy as np

    was = {m: m.training for m in model.modules()}
    held = {m: (set(vars(m)), {t: set(getattr(m, t, ())) for t in _ALL_HOOK_TABLES}) for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if training else []
    states = (np.random.get_state(), random.getstate())
    model.train(training)
    try:
        with torch.set_grad_enabled(grad), torch.random.fork_rng(devices=[]):
            torch.manual_seed(_TRAIN_SEED)
            np.random.seed(_TRAIN_SEED)
            random.seed(_TRAIN_SEED)
            yield
    finally:
        np.random.set_state(states[0])
        random.setstate(states[1])
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for m, t in was.items():
            m.training = t
        for m, (attributes, hooks) in held.items():
            _forget_additions(m, attributes, hooks)


def _forget_additions(m: nn.Module, attributes: set, hooks: dict) -> None:
    """Remove from ``m`` the instance attributes and hooks that are not among those it had (``attributes``, and
    the keys of each hook table in ``hooks``)."""
    for name in set(vars(m)) - attributes:
        delattr(m, name)
    for table, keys in hooks.items():
        for key in set(getattr(m, table, ())) - keys:
            del getattr(m, table)[key]


def run_example(model: nn.Module, example_input):
    """Every floating-point output of the model on ``example_input`` (tuples, dicts, ``ModelOutput`` fields, hidden
    states: :func:`every_output`), in eval mode and in train mode (dropout drawn from :data:`_TRAIN_SEED`), without
    grad; None without an example."""
    if example_input is None:
        return None
    share_with_fsdp(model)  # the rewrites so far, on a model FSDP2 sharded before the patch
    outs, extra = [], every_output(model)
    for training in (False, True):
        with mode(model, training):
            out = call(model, example_input, extra)
        outs += [t.detach().clone() for t in leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return outs


class Undo:
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

    def rollback(self, to: int = 0) -> None:
        """Undo the changes after the first ``to`` (all of them by default)."""
        while len(self.steps) > to:
            self.steps.pop()()


_ALL_HOOK_TABLES = MODULE_HOOK_TABLES  # every per-module hook table of nn.Module (torch_private)


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Forward, forward-pre, backward and full backward hooks registered on the replaced module keep firing on its
    drop-in, with the stock arguments (every rewrite returns the stock value). A full backward hook needs the
    module's ``_is_full_backward_hook`` flag too: without it the hooks were kept but never called."""
    for attr in _ALL_HOOK_TABLES:
        if hasattr(old, attr) and getattr(old, attr):
            getattr(new, attr).update(getattr(old, attr))
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


def replace(model: nn.Module, modules: dict, name: str, new: nn.Module, undo: Undo) -> None:
    parent_name, _, child = name.rpartition(".")
    undo.setattr(modules[parent_name] if parent_name else model, child, new)


#: Module hook tables; a norm with any of them, or a consumer with any but forward hooks, is not rewritten.
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooks_of(module: nn.Module, tables=_HOOK_TABLES) -> list[str]:
    return [t.strip("_").replace("_", " ") for t in tables if getattr(module, t, None)]
