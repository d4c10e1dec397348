"""The gated-MLP rewrite of :func:`~.patch.patch_model`: every down(act(gate(x))·up(x)) found on the example and
proven (:mod:`.glu_forms`) becomes a :class:`~approxbp.kernels.ops.glu.GatedMLP`, the exact fused op."""

from __future__ import annotations

import difflib

from torch import nn

from ..ops.glu import GatedMLP
from ..ops.modules import drop_in_classes
from . import swaps
from .activation_swap import ACTIVATION_CLASSES, class_key
from .common import (
    FILTERED,
    PatchConfig,
    PatchReport,
    RewriteGuard,
    Undo,
    by_pattern,
    call,
    every_output,
    hooks_of,
    mode,
    move_hooks,
    replace,
)
from .discovery import Discovery, run_once
from .glu_forms import layout_of, prove, record_calls

__all__ = ["check_glu_paths", "find_gated_mlps", "fuse_gated_mlps"]


def check_glu_paths(model: nn.Module, glu) -> None:
    """``glu=`` given as module paths: each must be one of ``model``'s (a path that matches nothing is refused with
    a "did you mean", never left unfused without a word)."""
    if isinstance(glu, bool):
        return
    paths = [n for n, _ in model.named_modules()]
    if unknown := sorted(set(glu) - set(paths)):
        near = {p: difflib.get_close_matches(p, paths, n=1) for p in unknown}
        raise ValueError("glu= names " + ", ".join(f"{p!r}" + (f" (did you mean {near[p][0]!r}?)" if near[p] else "")
                                                  for p in unknown) + ", which is no module path of this model")


def fuse_gated_mlps(model: nn.Module, report: PatchReport, undo: Undo, example_input, config: PatchConfig,
                    savings: RewriteGuard, discovery: Discovery | None = None) -> dict[str, list[str]]:
    """Replace every proven gated MLP by a :class:`~approxbp.kernels.ops.glu.GatedMLP` (``config.glu``: all, or these
    paths; modules ``config.module_filter_fn`` refuses are left and reported); return the activations called as
    functions outside them, {module path: activations} (one run of the example finds both, :func:`find_gated_mlps`,
    once per kind of model with a ``discovery``), for :func:`~.activation_swap.swap_activations`."""
    fuse = config.glu
    modules = dict(model.named_modules())
    layouts, inputs, functional = run_once(find_gated_mlps, model, example_input, discovery)
    wanted = (lambda name: fuse) if isinstance(fuse, bool) else (lambda name: name in fuse)
    found = {name: f for name, f in layouts.items()
             if f is not None and wanted(name) and not isinstance(modules[name], GatedMLP)}
    for pattern, group in by_pattern(list(found)):
        for names in savings.attempts(f"{pattern} (gated MLPs)", group):
            for name in names:
                how = found[name]
                why = (FILTERED if not config.wants(modules[name], name) else how if isinstance(how, str)
                       else _why_not_fused(modules, name, *how, inputs[name]))
                if why:
                    report.skipped.append(f"{name or 'the model'} ({type(modules[name]).__name__}): {why}")
                    continue
                new = GatedMLP(modules[name], *found[name])
                swaps.mark_replaced(new, modules[name])
                move_hooks(modules[name], new)
                replace(model, modules, name, new, undo)
                report.glus.append(f"{name}: {type(modules[name]).__name__} → GatedMLP({new.extra_repr()})")
    fused = {report.subject(line) for line in report.glus}
    owners = {}
    for where, act in functional:
        owner = modules[where]
        if where in fused or class_key(owner) in ACTIVATION_CLASSES or isinstance(owner, drop_in_classes()):
            continue
        owners.setdefault(where, [])
        if act not in owners[where]:
            owners[where].append(act)
    return owners


def find_gated_mlps(model: nn.Module, example_input) -> tuple[dict, dict, list[tuple[str, str]]]:
    """One run of the example (:func:`~.glu_forms.record_calls`): ({module: :func:`~.glu_forms.layout_of`'s answer},
    {module: its input's shape, all the proof reads of it}, [(module, activation) for every
    activation op])."""
    modules = dict(model.named_modules())

    def run():
        with mode(model, False):
            call(model, example_input, every_output(model))

    def activation_of(parent: str):
        def of(child: str):
            m = modules.get(f"{parent}.{child}" if parent else child)
            return ACTIVATION_CLASSES.get(class_key(m)) if m is not None else None
        return of

    records, functional = record_calls(model, run)
    layouts = {name: layout_of(rec, activation_of(name)) for name, rec in records.items()}
    inputs = {name: None if rec.x is None else tuple(rec.x.shape) for name, rec in records.items()}
    return layouts, inputs, functional


def _why_not_fused(modules, name, layout, act, shape) -> str | None:
    if not name:
        return "the model itself is a gated MLP; patch a model that holds it"
    if layout.act is not None and (hooks := hooks_of(modules[f"{name}.{layout.act}"])):
        return f"its activation {layout.act} has {', '.join(hooks)}; the fused op would not call it"
    return prove(modules[name], layout, act, shape)
