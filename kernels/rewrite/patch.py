"""patch_model: swap activations for their memory-saving versions, fuse gated MLPs into the exact GLU op and make
norms MS-norms; every rewrite returns the stock value, is proven on the example input (or skipped with its reason,
alone), and everything is undone on an error. The rewrites live in :mod:`.activation_swap`, :mod:`.glu_patch` and
:mod:`.norm_patch`; what they share (report, undo log, example runs, the saved-bytes check) in :mod:`.rewrite`."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..ops.glu import GatedMLP
from . import functional_swap, swaps
from .activation_swap import ACTIVATION_CLASSES, ACTIVATION_LIKE, class_key, swap_activations
from .common import (
    PatchConfig,
    PatchReport,
    RewriteGuard,
    Undo,
    every_output,
    output_difference,
    path_pattern,
    run_example,
)
from .discovery import Discovery
from .fsdp import share_with_fsdp
from .glu_patch import check_glu_paths, fuse_gated_mlps
from .moe_patch import fuse_expert_gates
from .norm_merge import unmerge_norm
from .norm_patch import replace_norms

__all__ = ["patch_model", "unpatch", "patched_state_dict", "PatchConfig", "PatchReport", "ACTIVATION_CLASSES",
           "ACTIVATION_LIKE", "class_key", "every_output", "path_pattern"]


def patch_model(model: nn.Module, *, family: str | None = "relu-sum", tables=None, module_filter_fn=None,
                norms: bool = True, example_input=None, check: bool = True, bits: int = 2, glu=True,
                config: PatchConfig | None = None, discovery: Discovery | None = None) -> PatchReport:
    """In place: replace every activation in :data:`ACTIVATION_CLASSES` (nn.GELU both ways, nn.SiLU, nn.Mish,
    nn.Softplus and the Hugging Face GELU/NewGELU/FastGELU/QuickGELU/SiLU/Mish classes) by its drop-in, fuse gated
    MLPs and make norms MS-norms, as :class:`~.common.PatchConfig` describes (``family``, ``tables``, ``norms``,
    ``glu``, ``bits``, ``module_filter_fn``: keyword arguments of the same names, or ``config=``).

    Every rewrite changes what is saved for backward, never what a reader sees. Norms: a LayerNorm/RMSNorm (found by
    what it computes) becomes a shared-output MS-norm that returns y by the stock module's own forward with z
    attached; its plain Linear consumers (found with torch.fx, or for models fx cannot trace by one run of
    ``example_input`` — a tensor, a tuple of positional arguments or a dict of keyword arguments — under a dispatch
    mode that sees every op reading the norm's output) save z in place of y; every other reader reads y as stock.
    Gated MLPs (with an example input) become :class:`~approxbp.kernels.ops.glu.GatedMLP` (saves g and u, no gradient
    error) once a float64 probe proves it.

    With ``example_input`` each group of rewrites is run against the stock outputs (eval and train mode) and its
    saved bytes measured: a group that changes an output is retried module by module and the module that cannot be
    proven is undone and reported; a group that saves nothing is undone and reported. ``check=False`` skips both
    (the planner patches fake tensors). On an error every change made so far is undone before it propagates.
    ``discovery``: a :class:`~.discovery.Discovery` that finds the norms' readers and the gated MLPs once for models
    built alike (the planner's, which builds its model afresh for each step it measures).

    Every argument after ``model`` is a keyword (0.1's positional, ``activation=``, ``norm=`` and ``plan=`` are gone:
    CHANGELOG.md)."""
    given = dict(family=family, tables=tables, module_filter_fn=module_filter_fn, norms=norms, bits=bits, glu=glu)
    if config is None:
        config = PatchConfig(**given)
    elif changed := [k for k, v in given.items() if v is not (d := patch_model.__kwdefaults__[k]) and v != d]:
        raise TypeError(f"patch_model(model, config=…) takes no other rewrite arguments (got {', '.join(changed)})")
    check_glu_paths(model, config.glu)
    report, undo = PatchReport(), Undo()
    before = run_example(model, example_input) if check else None
    try:
        savings = RewriteGuard(model, example_input, report, undo, measure=check, stock=before)
        if config.norms:
            replace_norms(model, report, undo, example_input, savings, config, discovery)
        functional = {}
        if example_input is not None and (config.glu or config.family is not None or config.tables is not None):
            functional = fuse_gated_mlps(model, report, undo, example_input, config, savings, discovery)
            if config.glu:
                fuse_expert_gates(model, report, undo, config, savings)
        elif not isinstance(config.glu, bool):  # named gated MLPs (a plan's) are reported, never silently left
            report.skipped += [f"{p}: listed in glu=, not fused: a gated MLP is fused only once an example input "
                               "proves it (pass example_input=…)" for p in sorted(config.glu)]
        if config.family is not None or config.tables is not None:
            swap_activations(model, report, undo, config, savings, functional)
        savings.close()
        share_with_fsdp(model)  # a model sharded by FSDP2 before the patch: its new modules hold sharded Parameters
        if before is not None:
            report.max_output_difference = _compare_outputs(before, run_example(model, example_input))
    except BaseException:
        undo.rollback()
        raise
    return report


def _compare_outputs(before: list, after: list) -> float:
    """The largest difference between the stock and the patched model's outputs (:func:`~.common.run_example`).
    Each group of rewrites was already proven (:class:`~.common.RewriteGuard`), so a difference here is a bug: it
    raises, and patch_model undoes everything."""
    largest, why = output_difference(before, after)
    if why:
        raise RuntimeError(f"patching changed {why} on the example input; the model is restored")
    return largest


@torch.no_grad()
def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model` in place: every drop-in goes back to the module it replaced and every MS-norm is
    unmerged (consumer weights and biases restored, the original norm back in place). Returns the model."""
    for _, parent in reversed(list(model.named_modules())):  # children first: a GatedMLP hands back restored ones
        functional_swap.uninstall(parent)
        swaps.remove_expert_gate(parent)
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
