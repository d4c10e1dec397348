"""patch_model: swap activations for their memory-saving versions and merge norms into their consumers."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from approxbp.approximations import tables as T
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import swaps
from .glu import GatedMLP
from .glu_forms import layout_of, prove, record_calls
from .norm_forms import is_norm_candidate, norm_form
from .norm_merge import (
    AffineInputLinear,
    NormInputLinear,
    consumer_features,
    is_mergeable_norm,
    keep_affine,
    merge_norm,
    proven_form,
    refuse_stock_state_dicts,
)

#: Activation modules by class name (torch and Hugging Face transformers, matched by name so that transformers
#: stays optional) → the registry activation whose tables replace them. nn.GELU is looked up with its
#: ``approximate`` attribute.
ACTIVATION_CLASSES = {
    "GELU": "gelu", "GELUActivation": "gelu",
    "GELU/tanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh", "FastGELUActivation": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh", "GELUTanh": "gelu_tanh", "AccurateGELUActivation": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu",
    "SiLU": "silu", "SiLUActivation": "silu",
    "Mish": "mish", "MishActivation": "mish",
    "ReLUSquaredActivation": "relu2",  # Nemotron, Primer: the exact table in either mode (no ReLU-sum fits it)
    "Softplus": "softplus",  # increasing: the exact one-branch table (saves y alone), in either mode
}
#: Class-name fragments of modules that look like activations; one that is not replaced is reported as skipped.
ACTIVATION_LIKE = ("GELU", "SiLU", "Swish", "Mish", "Activation", "ReLU", "Tanh", "Sigmoid", "Softplus", "ELU")
ACTIVATIONS = ("relu-sum", "invact", None)
OURS = ("ReLUSumActivation", "InvActivation", "ReGELU2", "ReSiLU2", "InvActGELU", "InvActSiLU")


@dataclass
class PatchReport:
    activations: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    max_output_difference: float | None = None
    glus: list[str] = field(default_factory=list)
    #: Bytes saved for backward by one training forward on the example (stock, patched); None: not measured.
    saved_bytes: tuple[int, int] | None = None

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
        return (f"swapped {len(self.activations)} activations, merged {len(self.norms)} norms{glus}{diff}"
                + (f"; skipped: {'; '.join(self.skipped)}" if self.skipped else ""))


def _class_key(module: nn.Module) -> str:
    name = type(module).__name__
    return "GELU/tanh" if name == "GELU" and getattr(module, "approximate", "none") == "tanh" else name


def _table_for(module: nn.Module, activation, bits: int):
    """(table name, path, dict or module; None) for one activation module, or (None, the reason)."""
    key = _class_key(module)
    if isinstance(activation, dict):
        for k in (type(module), key, type(module).__name__):
            if k in activation:
                return activation[k], None
        return None, "not in the activation mapping"
    name = ACTIVATION_CLASSES.get(key)
    if name is None and key in ("ReLU", "ReLU6"):
        return None, "already saves only its output (the next Linear saves it anyway): nothing to gain"
    if name is None:
        return None, "no table family for this activation"
    if key == "Softplus" and (module.beta != 1 or module.threshold < 20):  # torch returns x beyond the threshold
        return None, (f"beta = {module.beta:g}, threshold = {module.threshold:g}: not the table's log(1 + eˣ) (it "
                      "serves beta = 1, threshold ≥ 20, where float32 cannot tell them apart)")
    if activation in ("relu-sum", "invact") and (T.data_dir() / "invact" / f"{name}-exact.json").is_file():
        return f"invact/{name}-exact", None  # f′(f⁻¹(y)) in closed form (ReLU²): exact, in either mode
    if activation == "relu-sum":
        return f"relu_sum/{T.relu_sum_name(name, bits, 'primitive')}", None
    if activation == "invact":
        return f"invact/{name}-fast", None
    return activation, None  # a table path: used for every recognised activation


def _replacement(module: nn.Module, activation, bits: int, family_of):
    """(new module, None) or (None, why not) for an activation-like module; (None, None) for anything else.
    ``family_of(table)`` gives a table's family (cached per patch_model call: each table file is read once)."""
    from .invact import InvActGELU, InvActivation, InvActSiLU
    from .relu_sum import ReGELU2, ReLUSumActivation, ReSiLU2

    name = type(module).__name__
    mapped = isinstance(activation, dict) and (type(module) in activation or name in activation)
    if name in OURS or not (mapped or any(f.lower() in name.lower() for f in ACTIVATION_LIKE)):
        return None, None
    table, why = _table_for(module, activation, bits)
    if table is None:
        return None, why
    if isinstance(table, nn.Module):
        return table, None
    named = {"relu_sum/gelu-k2-primitive": ReGELU2, "relu_sum/silu-k2-primitive": ReSiLU2,
             "invact/gelu-fast": InvActGELU, "invact/silu-fast": InvActSiLU}
    if isinstance(table, str) and table in named:  # the papers' modules by their own names
        return named[table](), None
    typed = isinstance(table, dict | T.ReluSumTable | T.InvActTable)
    family = T.as_table(table).family if typed else family_of(str(table))
    return (ReLUSumActivation(table) if family == "relu-sum" else InvActivation(table)), None


def patch_model(model: nn.Module, activation="relu-sum", norm: bool = True, example_input=None,
                bits: int = 2, plan=None, check: bool = True, glu: bool | Collection[str] = True) -> PatchReport:
    """In place: replace every activation in :data:`ACTIVATION_CLASSES` (nn.GELU both ways, nn.SiLU, nn.Mish and
    the Hugging Face GELU/NewGELU/FastGELU/QuickGELU/SiLU/Mish classes) by its drop-in: ``activation='relu-sum'``
    (the k = ``bits`` primitive ReLU-sum table of that activation), ``'invact'`` (its fast invact table), a table
    path (used for every recognised activation), or a mapping {module class or class name: table path, table
    dict or module, or a module path: table or "exact"}; ``None`` swaps nothing. ``plan``: an ``approxbp plan``
    JSON file or its dict; its per-layer choices and MS-norm decision replace ``activation`` and ``norm``.
    Activation-like modules that are not replaced are listed in
    ``skipped`` with the reason. With ``norm=True`` merge every
    LayerNorm/RMSNorm whose outputs feed only Linear layers into them (eq. 58) and replace it by its
    MS-norm. Consumers are found with torch.fx; models fx cannot trace (e.g. Hugging Face ones) need an
    ``example_input`` (a tensor, a tuple of positional arguments or a dict of keyword arguments): one
    forward is run under a dispatch mode that sees every op reading each norm's output. A norm that feeds
    anything but Linear layers (views aside) is left alone and listed in the report's ``skipped``; so is a
    norm over several trailing dimensions, and one whose consumer's weight is shared with another module (tied
    embeddings), since merging would change that module too. Patching is all or nothing: on any error every
    change made so far is undone before the error propagates.

    With ``example_input`` the model is run (eval mode, no grad) before and after; the report gets the max
    output difference, and a difference above a dtype-aware tolerance (fp64 1e-6, fp32 1e-3, 16-bit 5e-2, times
    max(1, max|output|)) undoes the patch and raises; ``check=False`` skips that comparison (the planner patches
    fake tensors, which have no values).

    ``glu=True`` (with ``example_input``; not with a ``plan``, whose choices are per activation): every gated MLP,
    down(act(gate(x))·up(x)) with split or fused gate/up projections and the activation as a module or a function,
    becomes a :class:`~.glu.GatedMLP` (the exact fused op: saves g and u, no gradient error; it saves at least what
    an approximate activation would there) once a float64 probe proves it computes the same; its activation is then
    not swapped. Activations called as functions anywhere else are listed in ``skipped``. ``glu`` may also be the
    set of module paths to fuse (the planner's per-layer ``glu`` option; a plan's choices give it)."""
    if plan is not None:
        activation, norm, glu = _plan_choices(plan, model)
    if not (activation in ACTIVATIONS or isinstance(activation, dict) or _is_table(activation)):
        raise ValueError(f"activation must be one of {ACTIVATIONS}, a table path or a mapping, got {activation!r}")

    report, undo = PatchReport(), _Undo()
    before = _run_example(model, example_input) if check else None
    try:
        savings = _Savings(model, example_input, report, undo, measure=check)
        if norm:
            _merge_norms(model, report, undo, example_input, savings)
        if example_input is not None and (glu or activation is not None):
            _fuse_gated_mlps(model, report, undo, example_input, glu, savings)
        if activation is not None:
            _swap_activations(model, report, undo, activation, bits, savings)
        savings.close()
        if before is not None:
            after = _run_example(model, example_input)
            if len(after) != len(before) or any(a.shape != b.shape for a, b in zip(after, before)):
                raise RuntimeError("patching changed the structure of the model's outputs on the example input; the "
                                   "model is restored")
            report.max_output_difference = 0.0
            for i, (a, b) in enumerate(zip(after, before)):  # every floating output: logits, hidden states, …
                diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
                report.max_output_difference = max(report.max_output_difference, diff)
                tol = {torch.float64: 1e-6, torch.float32: 1e-3}.get(b.dtype, 5e-2)
                scale = max(1.0, float(b.double().abs().max())) if b.numel() else 1.0
                if not diff <= tol * scale:
                    raise RuntimeError(f"patching changed output {i} of the model by {diff:.3g} > {tol:g}·{scale:.3g} "
                                       "on the example input; the model is restored")
    except BaseException:
        undo.rollback()
        raise
    return report


def _swap_activations(model: nn.Module, report: PatchReport, undo: _Undo, activation, bits: int,
                      savings: _Savings) -> None:
    """Replace each activation module by its drop-in (patch_model's ``activation``), one pattern of paths at a
    time (:class:`_Savings`)."""
    family_of = functools.cache(lambda table: T.header(T.resolve(table))[0])  # each table file read once
    checked: dict = {}
    sites = [(f"{parent_name + '.' if parent_name else ''}{child_name}", parent, child_name, child)
             for parent_name, parent in model.named_modules() for child_name, child in parent.named_children()
             if not (isinstance(parent, GatedMLP) and child_name == parent.layout.act)]  # the fused op computes it
    for pattern, group in _by_pattern(sites, lambda site: site[0]):
        with savings.group(f"{pattern} (activations)"):
            for where, parent, child_name, child in group:
                chosen = activation.get(where) if isinstance(activation, dict) else None
                if chosen == "exact":
                    report.skipped.append(f"{where} ({type(child).__name__}): exact by choice")
                    continue
                new, why = _replacement(child, chosen or activation, bits, family_of)
                if new is not None and (mismatch := _computes_differently(child, new, checked)):
                    new, why = None, mismatch
                if new is None:
                    if why is not None:
                        report.skipped.append(f"{where} ({type(child).__name__}): {why}")
                    continue
                swaps.mark_replaced(new, child)  # for unpatch (not a submodule: no state-dict keys)
                _move_hooks(child, new)
                undo.setattr(parent, child_name, new)
                report.activations.append(
                    f"{where}: {type(child).__name__} → {type(new).__name__}({new.extra_repr()}); "
                    f"{error_of(new.spec)}"
                    + ("; inplace=True dropped: the drop-in returns a new tensor" if getattr(child, "inplace", False)
                       else ""))


@functools.cache
def error_of(spec) -> str:
    """The drop-in's gradient error, said once per table (:mod:`approxbp.approximations.gradient_error`) without
    the build side: an InvAct table's stored L∞, or a ReLU-sum table's levels against the derivative of its
    generated twin of f (torch autograd in float64)."""
    from approxbp.approximations.gradient_error import describe, invact_error, relu_sum_error

    if T.header(spec.path)[0] == "invact":
        return describe("invact", invact_error(T.stored_metrics(spec.path)))

    def df(x):  # real tensors, with grad, whatever the caller's mode (the planner's fake tensors)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.enable_grad():
            v = torch.tensor(x, dtype=torch.float64, requires_grad=True)
            return torch.autograd.grad(spec.module.activation_twin(v).sum(), v)[0].numpy()
    return describe("relu-sum", relu_sum_error(spec.module.KNOTS, spec.module.LEVELS, df))


def _fuse_gated_mlps(model: nn.Module, report: PatchReport, undo: _Undo, example_input, fuse,
                     savings: _Savings) -> None:
    """Replace every proven gated MLP by a :class:`~.glu.GatedMLP` (``fuse``); report activations called as
    functions outside them (one run of the example records both, :func:`~.glu_forms.record_calls`)."""
    modules = dict(model.named_modules())

    def run():
        with _mode(model, False):
            _call(model, example_input, every_output(model))

    def activation_of(parent: str):
        def of(child: str):
            m = modules.get(f"{parent}.{child}" if parent else child)
            return ACTIVATION_CLASSES.get(_class_key(m)) if m is not None else None
        return of

    records, functional = record_calls(model, run)
    wanted = (lambda name: fuse) if isinstance(fuse, bool) else (lambda name: name in fuse)
    found = {name: layout_of(rec, activation_of(name)) for name, rec in records.items()
             if wanted(name) and not isinstance(modules[name], GatedMLP)}
    found = {name: f for name, f in found.items() if f is not None}
    for pattern, group in _by_pattern(list(found)):
        with savings.group(f"{pattern} (gated MLPs)"):
            for name in group:
                why = found[name] if isinstance(found[name], str) else _why_not_fused(modules, name, *found[name],
                                                                                        records[name].x)
                if why:
                    report.skipped.append(f"{name or 'the model'} ({type(modules[name]).__name__}): {why}")
                    continue
                new = GatedMLP(modules[name], *found[name])
                swaps.mark_replaced(new, modules[name])
                _move_hooks(modules[name], new)
                _replace(model, modules, name, new, undo)
                report.glus.append(f"{name}: {type(modules[name]).__name__} → GatedMLP({new.extra_repr()})")
    fused = {report.subject(line) for line in report.glus}
    for where in dict.fromkeys(m for m, _ in functional):
        owner = modules[where]
        if where in fused or _class_key(owner) in ACTIVATION_CLASSES or type(owner).__name__ in OURS:
            continue
        acts = sorted({a for m, a in functional if m == where})
        report.skipped.append(f"{where or 'the model'} ({type(owner).__name__}): calls {', '.join(acts)} as a "
                              "function; only modules can be swapped, so it keeps torch's exact backward")


def _why_not_fused(modules, name, layout, act, x) -> str | None:
    if not name:
        return "the model itself is a gated MLP; patch a model that holds it"
    if layout.act is not None and (hooks := _hooks(modules[f"{name}.{layout.act}"])):
        return f"its activation {layout.act} has {', '.join(hooks)}; the fused op would not call it"
    return prove(modules[name], layout, act, x)


def path_pattern(name: str) -> str:
    """A module path with its layer indices as ``*``: the rewrites of one pattern are measured together."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def _by_pattern(items: list, name=lambda item: item) -> list[tuple[str, list]]:
    """``items`` grouped by the :func:`path_pattern` of their module path, patterns in order of first appearance."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(path_pattern(name(item)), []).append(item)
    return list(groups.items())


def _saved_on_example(model: nn.Module, example_input) -> int | None:
    """Bytes of distinct storages saved for backward by one train-mode forward on the example (parameters, which
    exist anyway, not counted); None when nothing in the model requires grad (nothing would be saved)."""
    from .saved import charged

    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        return None
    into: dict[str, int] = {}
    with _mode(model, True, grad=True), charged(into, exclude=params):
        _call(model, example_input)
    return sum(into.values())


class _Savings:
    """Never a loss: the bytes saved for backward on the example, measured after each group of rewrites (one
    pattern of module paths); a group after which they did not drop is undone and listed in ``skipped``."""

    def __init__(self, model: nn.Module, example_input, report: PatchReport, undo: _Undo, measure: bool):
        self.model, self.example, self.report, self.undo = model, example_input, report, undo
        self.bytes = _saved_on_example(model, example_input) if measure and example_input is not None else None
        self.before = self.bytes

    @contextlib.contextmanager
    def group(self, what: str):
        lists = (self.report.norms, self.report.glus, self.report.activations)
        marks = (len(self.undo.steps), *map(len, lists))
        yield
        if self.bytes is None or len(self.undo.steps) == marks[0]:
            return
        now = _saved_on_example(self.model, self.example)
        if now < self.bytes:
            self.bytes = now
            return
        done = [self.report.subject(line) for kept, mark in zip(lists, marks[1:]) for line in kept[mark:]]
        self.undo.rollback(marks[0])
        for kept, mark in zip(lists, marks[1:]):
            del kept[mark:]
        self.report.skipped.append(f"{what}: saves nothing here (with it, one training forward on the example saves "
                                   f"{now - self.bytes:+,} bytes more for backward); kept as it was: {', '.join(done)}")

    def close(self) -> None:
        if self.before is not None:
            self.report.saved_bytes = (self.before, self.bytes)
        elif self.bytes is None and self.example is not None:
            self.report.skipped.append("saved bytes: not measured, nothing in the model requires grad on the example")


def _plan_choices(plan, model: nn.Module) -> tuple[dict, bool, set[str]]:
    """An ``approxbp plan`` (JSON file or dict) → ({module path in ``model``: table path or "exact"}, MS-norms on,
    the gated MLPs to fuse: the parents of the layers whose option is ``glu``).
    The plan's layer paths are matched to the model's activation modules as they are or as a suffix (peft wraps
    the planned model as ``base_model.model.…``); each must match exactly one, and every activation of the model
    must be in the plan, else it was made for another model and is refused. Malformed plans are refused by field."""
    where = "plan" if isinstance(plan, dict) else str(plan)
    if not isinstance(plan, dict):
        try:
            plan = json.loads(Path(plan).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{where}: not a readable plan JSON file ({err})") from None
    layers, ms = (plan.get("layers"), plan.get("ms_norm")) if isinstance(plan, dict) else (None, None)
    if not isinstance(layers, dict) or not all(isinstance(v, dict) and isinstance(v.get("table"), str | None)
                                               for v in layers.values()):
        raise ValueError(f"{where}: 'layers' must map module paths to {{'table': a table name or null, …}}, as "
                         "`approxbp plan --out` writes it")
    if not isinstance(ms, dict) or not isinstance(ms.get("chosen"), bool):
        raise ValueError(f"{where}: 'ms_norm' must be {{'chosen': true or false, …}}, as `approxbp plan --out` "
                         "writes it")
    ours = [n for n, m in model.named_modules() if _class_key(m) in ACTIVATION_CLASSES]
    chosen, unmatched, fused = {}, [], set()
    for path, layer in layers.items():
        hits = [n for n in ours if n == path or n.endswith("." + path)]
        if len(hits) != 1:
            unmatched.append(f"{path} ({'no' if not hits else len(hits)} matching activation modules)")
            continue
        chosen[hits[0]] = T.resolve(layer["table"]) if layer["table"] else "exact"
        if layer.get("option") == "glu":
            fused.add(hits[0].rpartition(".")[0])
    missing = [n for n in ours if n not in chosen]
    if unmatched or missing:
        raise ValueError(f"{where} was made for another model: {len(layers)} planned layers, {len(ours)} activation "
                         f"modules here; unmatched in the plan: {unmatched[:3]}; not in the plan: {missing[:3]}")
    return chosen, ms["chosen"], fused


def _computes_differently(old: nn.Module, new: nn.Module, checked: dict) -> str | None:
    """Why ``new`` may not replace ``old`` (None when it may): both are run in float64 on a grid of [−8, 8] and must
    agree to 1e-9, so that a table of another activation (a GELU table on a SiLU) is never swapped in silently.
    ``checked`` remembers the verdict per (class, configuration, table) within one patch_model call."""
    spec = getattr(new, "spec", None)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    key = (type(old), old.extra_repr(), spec.key if spec is not None else id(new))
    if key not in checked:
        with unset_fake_temporarily():  # real numbers even when the model is being planned on fake tensors
            checked[key] = _compare_float64(old, new, spec)
    return checked[key]


def _compare_float64(old: nn.Module, new: nn.Module, spec) -> str | None:
    x = torch.linspace(-8, 8, 1601, dtype=torch.float64)

    def in_float64(m: nn.Module) -> nn.Module:  # a module with state is copied, never converted in place
        return copy.deepcopy(m).to(torch.float64) if any(True for _ in m.parameters()) or any(
            True for _ in m.buffers()) else m

    try:
        with torch.no_grad():
            # forward(): the user's hooks do not fire; each side gets its own copy of the grid, since an in-place
            # module (nn.SiLU(inplace=True)) overwrites its input
            want = in_float64(old).forward(x.clone())
            got = spec.forward_only_torch(x.clone()) if spec is not None else in_float64(new).forward(x.clone())
    except Exception as err:  # noqa: BLE001 - what cannot be checked is not swapped
        return (f"could not be checked against the drop-in on a float64 vector ({type(err).__name__}: {err}); "
                "not swapped")
    diff = float((got - want).abs().max())
    if not diff <= 1e-9 * max(1.0, float(want.abs().max())):
        what = f"table {spec.name()!r} ({spec.expression})" if spec is not None else type(new).__name__
        return f"{what} computes another function (max |difference| {diff:.3g} on [−8, 8]); not swapped"
    return None


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    """Forward and backward hooks registered on the replaced module keep firing on its drop-in."""
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(old, attr) and getattr(old, attr):
            getattr(new, attr).update(getattr(old, attr))


@torch.no_grad()
def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model` in place: every drop-in goes back to the module it replaced and every MS-norm is
    unmerged (consumer weights and biases restored, the original norm back in place). Returns the model."""
    from .norm_merge import unmerge_norm

    for _, parent in reversed(list(model.named_modules())):  # children first: a GatedMLP hands back restored ones
        for child_name, child in list(parent.named_children()):
            if isinstance(child, GatedMLP):
                swaps.replaced(child)._modules.update(child._modules)  # adapters added since stay
            if swaps.replaced(child) is not None:
                setattr(parent, child_name, swaps.replaced(child))
            elif swaps.merged(child) is not None:
                setattr(parent, child_name, unmerge_norm(child))
    return model


def patched_state_dict(model: nn.Module) -> dict:
    """The state dict of the stock architecture (norm weights back, consumers unmerged) for a patched model,
    which stays patched: ``Stock(...).load_state_dict(patched_state_dict(model))`` gives the same outputs."""
    return unpatch(copy.deepcopy(model)).state_dict()


def _is_table(value) -> bool:

    try:
        return isinstance(value, str | Path) and T.resolve(value).is_file()
    except FileNotFoundError:
        return False


def _call(fn, example_input, extra: dict | None = None):
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


def _leaves(out) -> list:
    """The tensors and other leaves of a model output (tuples, dicts, ``ModelOutput`` fields)."""
    return pytree.tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)


#: The seed both runs of the train-mode check draw their dropout masks from.
TRAIN_SEED = 0


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool, grad: bool = False):
    """Within: ``model`` in train or eval mode, without grad (``grad=True``: with), torch's, numpy's and Python's
    RNGs seeded with :data:`TRAIN_SEED` (wav2vec2-style models draw their time masks from numpy); on leaving, the
    RNG states, every module's mode and every buffer (BatchNorm's running statistics) are restored, so that a probe
    run changes nothing the model keeps."""
    import random

    import numpy as np

    was = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if training else []
    states = (np.random.get_state(), random.getstate())
    model.train(training)
    try:
        with torch.set_grad_enabled(grad), torch.random.fork_rng(devices=[]):
            torch.manual_seed(TRAIN_SEED)
            np.random.seed(TRAIN_SEED)
            random.seed(TRAIN_SEED)
            yield
    finally:
        np.random.set_state(states[0])
        random.setstate(states[1])
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for m, t in was.items():
            m.training = t


def _run_example(model: nn.Module, example_input):
    """Every floating-point output of the model on ``example_input`` (tuples, dicts, ``ModelOutput`` fields, hidden
    states: :func:`every_output`), in eval mode and in train mode (dropout drawn from :data:`TRAIN_SEED`), without
    grad; None without an example."""
    if example_input is None:
        return None
    outs, extra = [], every_output(model)
    for training in (False, True):
        with _mode(model, training):
            out = _call(model, example_input, extra)
        outs += [t.detach().clone() for t in _leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return outs


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

    def rollback(self, to: int = 0) -> None:
        """Undo the changes after the first ``to`` (all of them by default)."""
        while len(self.steps) > to:
            self.steps.pop()()


def _shared_parameters(model: nn.Module) -> set[int]:
    """Storage pointers of parameters reachable under more than one name (tied weights)."""
    names: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        ptr = p.untyped_storage()._cdata
        names[ptr] = names.get(ptr, 0) + 1
    return {ptr for ptr, n in names.items() if n > 1}


def _shape_query(node) -> bool:
    """x.shape / x.size() / x.dim() read no values: they do not stop the memory sharing."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("shape", "dtype", "device")
    return node.op == "call_method" and node.target in ("size", "dim")


def _merge_norms(model: nn.Module, report: PatchReport, undo: _Undo, example_input, savings: _Savings) -> None:
    for name, m in model.named_modules():  # norm-like modules that compute no LayerNorm/RMSNorm form: said why
        if is_norm_candidate(m) and isinstance(why := norm_form(m), str):
            report.skipped.append(f"{name} ({type(m).__name__}): {why}")
    unproven: dict[str, str] = {}
    try:
        found, foreign = _consumers_by_fx(model)
    except Exception as err:  # noqa: BLE001 - any tracing failure: fall back to running the model, or say why
        if example_input is None:
            report.skipped.append(f"norm merging: model is not fx-traceable ({type(err).__name__}: "
                                  f"{str(err)[:80]}); pass example_input to find consumers by running it")
            return
        found, foreign = _consumers_by_dispatch(model, example_input)
        if branches := _data_dependent_branches(model, example_input):  # proven block by block, then
            unproven = _unproven_regions(model, example_input, found, branches)
    modules = dict(model.named_modules())
    shared = _shared_parameters(model)
    for name, m in modules.items():  # proven norms that never ran (a BART decoder's cross-attention norm, run as a
        if name not in found and is_mergeable_norm(m):  # causal LM): nothing proves how their output is read
            report.skipped.append(f"{name}: not run on the example input (or not reached by tracing); left as it is")
    for name, (consumers, other) in found.items():  # rewritten by an earlier call: new readers must see α, β
        if swaps.merged(modules[name]) is not None:  # (correctness, never gated by the saving)
            _wrap_new_adapters(model, modules, name, consumers, other, report, undo)
        elif swaps.kept_affine(modules[name]):
            _wrap_new_consumers(model, modules, name, consumers, other, report, undo)
    new = [n for n in found if swaps.merged(modules[n]) is None and not swaps.kept_affine(modules[n])]
    for pattern, group in _by_pattern(new):
        with savings.group(f"{pattern} (norms)"):
            for name in group:
                _rewrite_norm(model, modules, name, *found[name], unproven, shared, foreign, report, undo)


def _rewrite_norm(model, modules, name, consumers, other, unproven, shared, foreign, report, undo) -> None:
    """One norm: MS-norm merged into its frozen consumers (eq. 58), or kept affine in wrapped trainable ones."""
    free = sorted(other) if consumers and other and all(map(_keeps_nothing, other)) else []
    ops_only = sorted(other) if not consumers and other and not any(map(_mutates, other)) else []
    why = unproven.get(name) or _why_not_rewritten(modules, name, consumers, set() if free else other,
                                                   ops_only=bool(ops_only))
    if why:
        report.skipped.append(f"{name}: {why}")
        return
    if free or ops_only or _trainable(modules[name], [modules[c] for c in consumers if not _is_adapter(c)]):
        ms, wrapped = keep_affine(modules[name], [modules[c] for c in consumers], shared_output=bool(free or ops_only))
        _replace(model, modules, name, ms, undo)
        for c, w in zip(consumers, wrapped):
            _move_hooks(modules[c], w)  # forward hooks see the same output (the others block: _hooks)
            _replace(model, modules, c, w, undo)
        made = f"{name} → {type(ms).__name__}"
        report.norms.append(
            f"{made}, saving z and σ⁻¹ in place of its input; its readers get α⊙z + β ({'; '.join(ops_only)})"
            if ops_only else f"{made}, α, β kept and applied by {consumers}"
            + (f"; {', '.join(free)} (keeping nothing for backward) read α⊙z + β" if free else ""))
        return
    why = _why_not_merged(modules, consumers, shared, foreign)
    if why:
        report.skipped.append(f"{name}: {why}")
        return
    adapters = [c for c in consumers if _is_adapter(c)]
    base = [c for c in consumers if c not in adapters]
    if not base:
        report.skipped.append(f"{name}: only adapter Linears ({adapters}) read it; nothing to merge into")
        return
    norm = modules[name]
    for c in base:
        undo.keep_linear(modules[c])
    ms = merge_norm(norm, [modules[c] for c in base])
    refuse_stock_state_dicts(model)
    _replace(model, modules, name, ms, undo)
    _wrap_adapters(model, modules, norm, adapters, undo)
    report.norms.append(f"{name} → {type(ms).__name__} merged into {base}"
                        + (f"; adapters {adapters} apply its α, β to their input" if adapters else ""))


#: Module hook tables; a norm with any of them, or a consumer with any but forward hooks, is not rewritten.
HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooks(module: nn.Module, tables=HOOK_TABLES) -> list[str]:
    return [t.strip("_").replace("_", " ") for t in tables if getattr(module, t, None)]


#: How a norm's output read as a model output (a hidden state) is listed among its other readers.
RETURNED = "returned as a model output"
#: Ops that keep nothing of a norm's output for backward: a norm whose other readers are only these (or the model's
#: return: a hidden state) becomes a shared-output MS-norm (post-LN encoders' residual add, Swin's pad).
KEEPS_NOTHING = ("add", "sub", "constant_pad_nd")


def _keeps_nothing(reader: str) -> bool:
    """``reader`` (an entry of a norm's other readers: ``op`` or ``op in module``) is an op in :data:`KEEPS_NOTHING`,
    or the model's return (a shared-output MS-norm returns the stock value)."""
    return reader.split(" in ")[0] in KEEPS_NOTHING or reader == RETURNED



def _mutates(reader: str) -> bool:
    """``reader`` (an entry of a norm's other readers) writes into the norm's output: an in-place op (``add_``,
    ``index_put_``) or an item assignment. A norm that returns α⊙z + β must not see it written (z is saved)."""
    op = reader.split(" in ")[0]
    return op.endswith("_") or op == "setitem"


def _why_not_rewritten(modules: dict, name: str, consumers: list[str], other: set[str],
                       ops_only: bool = False) -> str | None:
    """Why the norm ``name`` may not become an MS-norm read by ``consumers`` (None when it may). ``ops_only``: no
    Linear reads it, only ops that do not write into it (``other``): it then saves z and σ⁻¹ in place of its input
    and returns α⊙z + β (a post-norm before a residual add, a QK-norm before RoPE)."""
    norm = modules[name]
    if not ops_only and (other or not consumers):
        mutating = sorted(filter(_mutates, other))
        return ("output feeds something other than Linear layers" + (f" ({', '.join(sorted(other))})" if other else "")
                + (f", and {', '.join(mutating)} write(s) into it" if mutating and not consumers else ""))
    if hooks := _hooks(norm):
        return f"has {', '.join(hooks)}; rewritten, it would return z, so they would see another tensor"
    for c in consumers:
        if hooks := _hooks(modules[c], HOOK_TABLES[1:]):
            return f"consumer {c} has {', '.join(hooks)}; they would see z, not the norm's output α⊙z + β"
    dim = proven_form(norm).dim
    wrong = [c for c in consumers if consumer_features(modules[c])[0] != dim]
    if wrong:
        return f"consumer(s) {wrong} do not read its {dim} features as their input features"
    own = {p.dtype for p in norm.parameters()}  # QLoRA keeps norms in fp32 over a bf16 model: α⊙z is then fp32,
    theirs = {w.dtype for c in consumers  # which a merged form, computing in the Linears' dtype, would not be
              if isinstance(w := getattr(getattr(modules[c], "base_layer", modules[c]), "weight", None), torch.Tensor)}
    if own and theirs and not own <= theirs:
        return (f"its {'/'.join(sorted(str(d).removeprefix('torch.') for d in own))} weights promote what its "
                f"{'/'.join(sorted(str(d).removeprefix('torch.') for d in theirs))} readers get; merged, they would "
                "not (left as it is)")
    return None


def _why_not_merged(modules: dict, consumers: list[str], shared: set[int], foreign: dict) -> str | None:
    """Why a frozen norm's affine may not be folded into its consumers' weights (eq. 58; None when it may)."""
    if any(type(modules[c]).__name__ == "Conv1D" for c in consumers):
        return "frozen, but a consumer is a Conv1D; merging folds into nn.Linear only"
    tied = [c for c in consumers if any(p.untyped_storage()._cdata in shared
                                        for p in modules[c].parameters(recurse=False))]
    if tied:
        return f"consumer(s) {tied} share their weight with another module (tied weights); merging would change " \
               "that module too"
    used = {c: sorted(foreign[c]) for c in consumers if c in foreign}
    if used:
        return f"consumer weights are also read outside the consumer ({used}); merging would change those uses too"
    return None


def _trainable(norm: nn.Module, consumers: list[nn.Module]) -> bool:
    """Merging α, β into W (eq. 58) is exact only when nothing of it trains (LoRA/QLoRA's frozen base): otherwise
    the optimiser would see W·diag α instead of W and α, and training would change."""
    return any(p.requires_grad for m in (norm, *consumers) for p in m.parameters())


def _wrap_new_consumers(model, modules, name, consumers, other, report, undo) -> None:
    """Patch, then LoRA, then patch again: Linears that read the MS-norm's z since the first call (LoRA's adapters)
    get its α, β too, so that they see the input they see in the stock model."""
    ms = modules[name]
    new = [c for c in consumers if not isinstance(modules[c], NormInputLinear)]
    if not new:
        return
    if other:
        report.skipped.append(f"{name}: {new} read it, but so does {sorted(other)}; left as they are")
        return
    for c in new:
        w = NormInputLinear(modules[c], ms)
        swaps.mark_replaced(w, modules[c])
        _replace(model, modules, c, w, undo)
    report.norms.append(f"{name} (patched before): {new} now apply its α, β to their input")


def _wrap_new_adapters(model, modules, name, consumers, other, report, undo) -> None:
    """Patch, then LoRA, then patch again: the adapters added since read the MS-norm's z; give them the norm's α, β
    (as LoRA-then-patch does), so that they see the input they would see in the unpatched model."""
    new = [c for c in consumers if _is_adapter(c) and not isinstance(modules[c], AffineInputLinear)]
    if not new:
        return
    if other:
        report.skipped.append(f"{name}: adapters {new} read it, but so does {sorted(other)}; left as they are")
        return
    norm = swaps.merged(modules[name])[0]
    _wrap_adapters(model, modules, norm, new, undo)
    report.norms.append(f"{name} (merged before): adapters {new} now apply its α, β to their input")


def _wrap_adapters(model, modules, norm, adapters, undo) -> None:
    """LoRA's lora_A: unchanged weight, reads z and applies the norm's α, β itself (AffineInputLinear)."""
    form = proven_form(norm)
    alpha = form.alpha(norm)
    alpha = torch.ones(form.dim) if alpha is None else alpha
    for c in adapters:
        wrapped = AffineInputLinear(modules[c], alpha, form.beta(norm))
        swaps.mark_replaced(wrapped, modules[c])
        _replace(model, modules, c, wrapped, undo)


def _watched(module: nn.Module) -> bool:
    """A norm to patch, or an MS-norm an earlier call made (whose new consumers may need wrapping)."""
    return is_mergeable_norm(module) or swaps.merged(module) is not None or swaps.kept_affine(module)


def _is_consumer(module: nn.Module) -> bool:
    """nn.Linear, or Hugging Face's Conv1D (GPT-2: a Linear with its weight stored transposed)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _is_adapter(name: str) -> bool:
    """A LoRA adapter's down-projection (peft's ``…lora_A.<adapter>``): trainable, its weight must stay its own."""
    return "lora_A" in name.split(".")


def _replace(model: nn.Module, modules: dict, name: str, new: nn.Module, undo: _Undo) -> None:
    parent_name, _, child = name.rpartition(".")
    undo.setattr(modules[parent_name] if parent_name else model, child, new)


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer, with norms (whatever library defines them) and consumers kept as calls of their module.
    The leaves are chosen before tracing: while it traces, reading a module's parameter records a graph node."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.leaves = {id(m) for m in model.modules() if _watched(m) or _is_consumer(m)}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, qualname)


def _consumers_by_fx(model: nn.Module) -> tuple[dict, dict]:
    """({norm name: (consumer names, other users)}, {consumer: graph nodes that read its parameters outside it})
    from torch.fx.symbolic_trace, over every call site of every norm. A consumer that is also called on something
    else, or that reads two norms, is reported as another user: a rewrite of it would change those calls too."""
    graph = _LeafTracer(model).trace(model)
    modules = dict(model.named_modules())
    found: dict[str, tuple[list[str], set[str]]] = {}
    foreign: dict[str, set[str]] = {}
    reads: dict[str, list] = {}  # consumer → the norm (or None) each of its call sites reads
    for node in graph.nodes:
        if node.op == "get_attr" and node.users:  # a parameter used outside its module (F.linear(z, enc.weight.t()))
            owner = str(node.target).rpartition(".")[0]
            if owner in modules and _is_consumer(modules[owner]):
                foreign.setdefault(owner, set()).add(f"{node.target} read by {sorted(map(str, node.users))}")
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
    return found, foreign


def _data_dependent_branches(model: nn.Module, example_input, args=None) -> str | None:
    """Why one run of ``model`` cannot stand for every input (None when it can): torch._dynamo traces one forward
    and reports a graph break at Python control flow on a tensor's value (``if x.sum() > 0``, ``.item()``), where
    another input would run other code. ``args``: (positional, keyword) arguments instead of ``example_input``.
    Runs in eval mode and in train mode (wav2vec2's layer drop branches on ``torch.rand([])`` only when
    training), without grad, with the RNG state restored."""
    reasons = []
    for training in (False, True):
        try:
            with _mode(model, training):
                explain = torch._dynamo.explain(model)
                result = explain(*args[0], **args[1]) if args is not None else _call(explain, example_input)
        except Exception as err:  # noqa: BLE001 - what cannot be checked is not rewritten
            return f"could not check with torch._dynamo ({type(err).__name__}: {' '.join(str(err).split())[:80]})"
        reasons += [" ".join(str(r.reason).split()) for r in result.break_reasons]
    dependent = [r for r in reasons if any(k in r for k in ("generic_jump", "data-dependent", "data dependent",
                                                            "Data-dependent", "item()", "__bool__"))]
    return "; ".join(sorted(set(r[:80] for r in dependent))) or None


def _unproven_regions(model: nn.Module, example_input, found: dict, branches: str) -> dict[str, str]:
    """{norm: why its rewrite cannot be proven} when the whole model branches on tensor values (``branches``).
    A norm is still proven when the smallest module holding it and all its readers (its region: a decoder layer,
    say) has no such branch and does not return the norm's output: whatever branch the model takes, that region
    computes the same graph around the norm."""
    names = {n: _region(n, consumers) for n, (consumers, _) in found.items()}
    modules = dict(model.named_modules())
    seen, escapes = _region_calls(model, example_input, {r for r in names.values() if r}, set(names))
    verdicts, why = {}, {}
    for norm, region in names.items():
        if not region or region not in seen:
            why[norm] = (f"the model branches on tensor values ({branches}) outside any block holding this norm and "
                         "its readers, so one run of example_input cannot prove the rewrite")
        elif (region, norm) in escapes:
            why[norm] = f"its output leaves {region}, and the model branches on tensor values ({branches})"
        else:  # each region on its own: blocks of one class may take other code by their attributes
            if region not in verdicts:
                verdicts[region] = _data_dependent_branches(modules[region], None, seen[region])
            if verdicts[region]:
                why[norm] = f"{region} branches on tensor values ({verdicts[region]}); one run cannot prove the rewrite"
    return why


def _region(norm: str, consumers: list[str]) -> str:
    """The smallest module that holds the norm and every consumer ('' for the model itself)."""
    parts = [n.split(".") for n in (norm, *consumers)]
    common = [p[0] for p in itertools.takewhile(lambda p: len(set(p)) == 1, zip(*parts))]
    return ".".join(common[:len(parts[0]) - 1]) if common == parts[0] else ".".join(common)


def _region_calls(model: nn.Module, example_input, regions: set[str], norms: set[str]):
    """One eval run: ({region: (args, kwargs) of its first call}, {(region, norm): the region returned the norm's
    output})."""
    seen, outs, escapes, handles = {}, {}, set(), []
    modules = dict(model.named_modules())

    def enter(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, (args, kwargs))
        return hook

    def leave(name):
        def hook(module, args, out):
            ptrs = {t.untyped_storage()._cdata for t in _leaves(out) if isinstance(t, torch.Tensor)}
            escapes.update((name, n) for n, t in outs.items()
                           if t.untyped_storage()._cdata in ptrs and n.startswith(name + "."))
        return hook

    def norm_out(name):
        def hook(module, args, out):
            outs[name] = out  # kept alive: a freed output's address could be reused by the block's output
        return hook

    for r in regions:
        handles += [modules[r].register_forward_pre_hook(enter(r), with_kwargs=True),
                    modules[r].register_forward_hook(leave(r))]
    handles += [modules[n].register_forward_hook(norm_out(n)) for n in norms]
    try:
        with _mode(model, False):
            _call(model, example_input, every_output(model))
    finally:
        for h in handles:
            h.remove()
    return seen, escapes


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
        self.param_owner: dict[int, str] = {}  # storage pointer of a consumer's parameter → the consumer
        self.inside: str | None = None  # the nn.Linear currently running
        self.running: list[str] = []  # the other leaf modules running now, innermost last (to name an op's place)
        self.found: dict[str, tuple[list[str], set[str]]] = {}
        self.foreign: dict[str, set[str]] = {}  # consumer → ops outside it that read its parameters
        self.keep: list[torch.Tensor] = []  # watched tensors stay alive, so that no storage pointer is reused
        self.read_now: set[str] = set()  # the norms the running consumer call has read
        self.reads: dict[str, list] = {}  # consumer → the norm (or None) each of its calls read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads_values = not func.is_view and func.overloadpacket not in _METADATA
        for t in pytree.tree_leaves((args, kwargs or {})):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage()._cdata
            consumer = self.param_owner.get(ptr)
            if consumer is not None and consumer != self.inside and reads_values:
                self.foreign.setdefault(consumer, set()).add(str(func.overloadpacket.__name__))
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
        self.owner[t.untyped_storage()._cdata] = (name, t)
        self.found.setdefault(name, ([], set()))


def _consumers_by_dispatch(model: nn.Module, example_input) -> tuple[dict, dict]:
    """({norm name: (consumer Linear names, other ops)}, {consumer: ops outside it that read its parameters}) from
    the forward under :class:`_ReadWatch`, run in eval mode and in train mode (dropout between a norm and a Linear
    is visible only there), asking for every output (:func:`every_output`)."""
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
            for p in m.parameters(recurse=False):
                watch.param_owner[p.untyped_storage()._cdata] = name
    extra = every_output(model)
    try:
        for training in (False, True):
            with _mode(model, training), watch:
                out = _call(model, example_input, extra)
            for t in _leaves(out):  # a norm output that is also returned (hidden states) must stay as it is
                name = watch.owner.get(t.untyped_storage()._cdata) if isinstance(t, torch.Tensor) else None
                if name is not None:
                    watch.found[name[0]][1].add(RETURNED)
    finally:
        for h in handles:
            h.remove()
    _account_call_sites(watch.found, watch.reads)
    return watch.found, watch.foreign
